"""SLO-driven pool sizing (DistServe-style), pure code: no Ray, no sockets.

engine/profile.py  latency models fitted from measured step times (shared with decode workers)
workload.py traces and Poisson workloads
simulator.py discrete-event simulation of disaggregated or colocated pools
search.py   per-instance capacity under SLOs, instances per pool, plans
"""
