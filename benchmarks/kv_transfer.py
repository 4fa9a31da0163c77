"""KV transfer bandwidth per transport, against the network and memory limits, and the TTFT
of a 2048-token prompt disaggregated vs the offline engine's prefill — all in one run.

Bandwidth: the KV of a 2048-token SmolLM2 prompt (30 layers x 2048 tokens x K,V x 3 heads
x 64 dims, fp32: ~94 MB) is shipped layer by layer from one process into a decode-side
ReservationTable in another, by each transport; against
  - network limit: a plain TCP socket over loopback moving the same bytes between two
    processes (recv_into a preallocated buffer);
  - memory limit: an in-process `copy_` into a preallocated tensor.
It also records the CPU time both processes spend per transfer (socket and torch): on a
small machine the two ends share the cores, so CPU per byte bounds throughput.
TTFT: real prefill and decode worker processes, each pinned to its own core (taskset,
one thread), max_tokens=1, vs the offline engine prefilling the same prompt in one
process pinned to one core.

Writes benchmarks/results/kv_transfer.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.report import panels, write  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
LAYERS, TOKENS, KV_HEADS, HEAD_DIM = 30, 2048, 3, 64


def layout():
    from pdserve.kv_transfer.layout import KVLayout

    return KVLayout(LAYERS, 16, KV_HEADS, HEAD_DIM, "float32")


def kv_bytes() -> int:
    return LAYERS * TOKENS * layout().token_bytes


# ---------------------------------------------------------------- limits
def memory_copy_gbps(repeats: int) -> float:
    src = torch.randn(kv_bytes() // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return kv_bytes() / statistics.median(times) / 1e9


def _socket_receiver(port_queue, size: int, repeats: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    buffer = bytearray(size)
    view = memoryview(buffer)
    cpu = []
    for _ in range(repeats):
        got, start = 0, time.process_time()
        while got < size:
            got += conn.recv_into(view[got:], size - got)
        cpu.append(time.process_time() - start)
        conn.sendall(b"k")
    conn.close()
    port_queue.put(cpu)


def _cpu_ms(sender: list[float], receiver: list[float]) -> float:
    """Median CPU milliseconds per transfer, both processes (all their threads) together."""
    return 1e3 * statistics.median(a + b for a, b in zip(sender, receiver, strict=True))


def socket_gbps(repeats: int, cpu_ms: list | None = None) -> float:
    size = kv_bytes()
    ctx = mp.get_context("spawn")
    port_queue = ctx.Queue()
    receiver = ctx.Process(target=_socket_receiver, args=(port_queue, size, repeats))
    receiver.start()
    sock = socket.create_connection(("127.0.0.1", port_queue.get()))
    payload = memoryview(bytearray(os.urandom(1024)) * (size // 1024))
    times, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        sock.sendall(payload)
        sock.recv(1)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    sock.close()
    if cpu_ms is not None:
        cpu_ms.append(_cpu_ms(cpu, port_queue.get()))
    receiver.join()
    return size / statistics.median(times) / 1e9


# ---------------------------------------------------------------- transports
def _torch_receiver(conn, repeats: int, shuffled: bool) -> None:
    from pdserve.kv_transfer.reservations import ReservationTable
    from pdserve.kv_transfer.torch_transport import TorchTransport

    lay = layout()
    blocks = TOKENS // lay.block_size
    cache = torch.zeros(LAYERS, 2, blocks, lay.block_size, KV_HEADS, HEAD_DIM)
    table = ReservationTable(lay, cache)
    transport = TorchTransport("decode", lay, "cpu", max_piece_tokens=TOKENS)
    conn.send(transport.listen(table))
    conn.send(transport.accept("prefill"))
    block_table = torch.randperm(blocks).tolist() if shuffled else list(range(blocks))
    for _ in range(repeats):
        reservation = table.register("r", block_table, TOKENS, peer="prefill")
        start = time.process_time()
        conn.send(reservation.transfer_id)
        reservation.done.wait(120)
        assert reservation.complete, reservation.error
        table.release(reservation.transfer_id)
        conn.send(time.process_time() - start)
    transport.wait_closed("prefill")  # the sender's goodbye ends the pair
    transport.close()


def torch_gbps(repeats: int, shuffled: bool = False, cpu_ms: list | None = None) -> float:
    """Into consecutive cache blocks, or (`shuffled`) into blocks in random order, as a
    long-running decode worker's free list hands them out. Appends the median CPU
    milliseconds per transfer to `cpu_ms`, if given."""
    from pdserve.kv_transfer.torch_transport import TorchTransport

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    receiver = ctx.Process(target=_torch_receiver, args=(child, repeats, shuffled))
    receiver.start()
    parent.recv()
    endpoint = parent.recv()
    sender = TorchTransport("prefill", layout(), "cpu", max_piece_tokens=TOKENS).connect(endpoint)
    k = torch.randn(TOKENS, KV_HEADS, HEAD_DIM)
    v = torch.randn(TOKENS, KV_HEADS, HEAD_DIM)
    times, cpu, receiver_cpu = [], [], []
    for _ in range(repeats):
        transfer_id = parent.recv()
        start, start_cpu = time.perf_counter(), time.process_time()
        for layer in range(LAYERS):
            sender.send(transfer_id, layer, 0, k, v)
        receiver_cpu.append(parent.recv())
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    if cpu_ms is not None:
        cpu_ms.append(_cpu_ms(cpu, receiver_cpu))
    sender.close()
    receiver.join()
    return kv_bytes() / statistics.median(times) / 1e9


def _grpc_sender_server(port_queue, repeats: int) -> None:
    """A minimal PrefillWorker whose Prefill stream ships the KV with GrpcStreamSender."""

    from pdserve.kv_transfer.grpc_transport import GrpcStreamSender
    from pdserve.protos import pdserve_pb2 as pb
    from pdserve.protos import pdserve_pb2_grpc as pb_grpc
    from pdserve.rpc.channel import new_server
    from pdserve.testkit.workers import SECURITY

    k = torch.randn(TOKENS, KV_HEADS, HEAD_DIM)
    v = torch.randn(TOKENS, KV_HEADS, HEAD_DIM)

    class Shipper(pb_grpc.PrefillWorkerServicer):
        async def Prefill(self, request_iterator, context):
            start = (await anext(aiter(request_iterator))).start
            loop = asyncio.get_running_loop()
            sender = GrpcStreamSender(loop, layout(), lambda t, layer, s, n, data: pb.KVChunk(
                transfer_id=t, layer=layer, token_start=s, num_tokens=n, data=data))

            def produce():
                for layer in range(LAYERS):
                    sender.send(start.transfer_id, layer, 0, k, v)
                loop.call_soon_threadsafe(sender.finish)

            producer = loop.run_in_executor(None, produce)
            async for chunk in sender.messages():
                yield pb.PrefillServerMessage(kv=chunk)
            await producer

    async def serve():
        server = new_server(SECURITY)
        pb_grpc.add_PrefillWorkerServicer_to_server(Shipper(), server)
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def grpc_gbps(repeats: int) -> float:

    from pdserve.kv_transfer.reservations import ReservationTable
    from pdserve.protos import pdserve_pb2 as pb
    from pdserve.protos import pdserve_pb2_grpc as pb_grpc
    from pdserve.rpc.channel import open_channel
    from pdserve.testkit.workers import SECURITY

    ctx = mp.get_context("spawn")
    port_queue = ctx.Queue()
    server = ctx.Process(target=_grpc_sender_server, args=(port_queue, repeats), daemon=True)
    server.start()
    port = port_queue.get()
    lay = layout()
    blocks = TOKENS // lay.block_size
    table = ReservationTable(lay, torch.zeros(LAYERS, 2, blocks, lay.block_size, KV_HEADS, HEAD_DIM))

    async def run() -> list[float]:
        times = []
        async with open_channel(f"127.0.0.1:{port}", SECURITY) as channel:
            stub = pb_grpc.PrefillWorkerStub(channel)
            for _ in range(repeats):
                reservation = table.register("r", list(range(blocks)), TOKENS)
                start = time.perf_counter()
                call = stub.Prefill(iter([pb.PrefillClientMessage(
                    start=pb.PrefillRequest(transfer_id=reservation.transfer_id))]))
                async for message in call:
                    c = message.kv
                    table.write_bytes(c.transfer_id, c.layer, c.token_start, c.num_tokens, c.data)
                assert reservation.complete
                times.append(time.perf_counter() - start)
                table.release(reservation.transfer_id)
        return times

    times = asyncio.run(run())
    server.terminate()
    return kv_bytes() / statistics.median(times) / 1e9


# ---------------------------------------------------------------- TTFT
PINNED_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def offline_prefill_s(model: str, prompt: list[int], repeats: int) -> list[float]:
    code = f"""
import json, time, torch
torch.set_num_threads(1)
from pdserve.engine import LLM, SamplingParams
llm = LLM({model!r}, max_num_batched_tokens={TOKENS})
prompt = {prompt!r}
llm.generate([prompt[:64]], SamplingParams(max_tokens=1))
times = []
for _ in range({repeats}):
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    times.append(time.perf_counter() - start)
print("RESULT", json.dumps(times))
"""
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, **PINNED_ENV}, check=True)
    return json.loads(out.stdout.split("RESULT", 1)[1])


def disaggregated_ttft_s(model: str, prompt: list[int], repeats: int, transport: str) -> list[float]:
    from pdserve.testkit.workers import WorkerProcess, decode_stub, generate_request

    args = ("--max-num-batched-tokens", str(TOKENS))
    env = {**PINNED_ENV}
    with WorkerProcess("prefill", model, *args, env=env, launcher=("taskset", "-c", "0")) as p, \
            WorkerProcess("decode", model, *args, env=env, launcher=("taskset", "-c", "1")) as d:

        async def run() -> list[float]:
            channel, stub = decode_stub(d.address)
            times = []
            async with channel:
                for i in range(repeats + 1):
                    ids = prompt if i else prompt[:64]  # the first request warms up the pair
                    start = time.perf_counter()
                    call = stub.Generate(generate_request(f"ttft-{transport}-{i}", ids, 1, [p.address], transport))
                    first = await call.read()
                    elapsed = time.perf_counter() - start
                    assert first.prefilled_by not in ("", "local"), "not prefilled remotely"
                    if i:
                        times.append(elapsed)
            return times

        return asyncio.run(run())


def plot(result: dict, path: Path) -> None:
    with panels(path, 2, width=5.0) as [ax1, ax2]:
        bw = result["bandwidth_gbps"]
        ax1.bar([n.replace("_", "\n") for n in bw], list(bw.values()), color=["#999", "#999", "#2a7", "#2a7", "#2a7"])
        ax1.set_ylabel("GB/s (median of rounds)")
        ax1.set_title("94 MB of KV, loopback")
        ttft = result["ttft_s_median"]
        ax2.bar([n.replace("_", "\n") for n in ttft], list(ttft.values()), color=["#999", "#2a7", "#2a7"])
        ax2.set_ylabel("seconds (median)")
        ax2.set_title(f"TTFT, {TOKENS}-token prompt, one core per process")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--repeats", type=int, default=20, help="transfers per measure (median)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of all bandwidth measures")
    parser.add_argument("--ttft-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "kv_transfer.json")
    args = parser.parse_args()

    from pdserve.engine.model_source import resolve_model

    model = str(resolve_model(args.model))
    result = {"kv_bytes": kv_bytes(), "ttft_s": {}}
    cpu = result["cpu_ms_per_transfer_rounds"] = {"tcp_socket": [], "torch_gloo": [], "torch_gloo_shuffled_blocks": []}
    measures = {"memory_copy": memory_copy_gbps,
                "tcp_socket": lambda n: socket_gbps(n, cpu["tcp_socket"]),
                "torch_gloo": lambda n: torch_gbps(n, cpu_ms=cpu["torch_gloo"]),
                "torch_gloo_shuffled_blocks": lambda n: torch_gbps(n, True, cpu["torch_gloo_shuffled_blocks"]),
                "grpc": grpc_gbps}
    rounds = result["bandwidth_gbps_rounds"] = {name: [] for name in measures}
    for round_index in range(args.rounds):  # interleaved: the machine's load drifts
        print(f"bandwidth round {round_index + 1}/{args.rounds} ...", flush=True)
        for name, measure in measures.items():
            rounds[name].append(measure(args.repeats))
    result["bandwidth_gbps"] = {name: statistics.median(v) for name, v in rounds.items()}
    result["cpu_ms_per_transfer"] = {name: statistics.median(v) for name, v in cpu.items()}
    for name in ("torch_gloo", "torch_gloo_shuffled_blocks", "grpc"):  # same-round ratios
        result[f"{name}_over_socket"] = statistics.median(
            a / b for a, b in zip(rounds[name], rounds["tcp_socket"], strict=True))

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 40000, (TOKENS,), generator=gen).tolist()
    print("TTFT ...", flush=True)
    result["ttft_s"]["offline_prefill"] = offline_prefill_s(model, prompt, args.ttft_repeats)
    for transport in ("torch", "grpc"):
        result["ttft_s"][f"disaggregated_{transport}"] = disaggregated_ttft_s(model, prompt, args.ttft_repeats,
                                                                               transport)
    result["ttft_s_median"] = {k: statistics.median(v) for k, v in result["ttft_s"].items()}
    base = result["ttft_s_median"]["offline_prefill"]
    result["ttft_ratio_vs_offline"] = {k: v / base for k, v in result["ttft_s_median"].items()}

    write(result, args.out, plot)


if __name__ == "__main__":
    main()
