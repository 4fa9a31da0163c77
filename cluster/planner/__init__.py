"""SLO-driven pool sizing (DistServe-style), pure code: no Ray, no sockets.

profile.py  latency models fitted from measured step times
workload.py traces and Poisson workloads
simulator.py discrete-event simulation of disaggregated or colocated pools
search.py   per-instance capacity under SLOs, instances per pool, plans
"""
