"""Model forward: Llama-family decoder, paged attention, weight loading."""
