"""The P/D benchmark: pd-extproc against direct decode, plain Envoy, vllm-router and smg, on one machine, with
two floors in the same rounds (bench/floor: a do-nothing grpc.aio and a do-nothing compiled ext_proc server
behind our own Envoy bootstrap) and our server's per-stage CPU (bench/stages.py).

Run it with ``make bench``. The systems of a worker set (bench/systems.py) talk to the same two workers
(one prefill, one decode): cheap workers (bench/cheap_worker.py) for the headline table, where the
workers are never the bottleneck (a run is invalid unless direct decode reaches 5x the fastest P/D
proxy), and emulated vLLM workers with a KV ledger for the second table. The load generator is wrk, and
the measurement points of all systems are interleaved round by round so machine noise falls on all of
them alike. A size sweep (1 KiB to 8 MiB, chat and completions) prices each byte of a prompt against
vllm-router's and checks the growth is not super-linear (bench/sweep_report.py). See bench/RESULTS.md.

The soak (bench/soak.py, ``make soak``; results in bench/SOAK.md) is separate: the stack under a mixed
load and scheduled faults for an hour, checked for leaks and undocumented answers, not timed.
"""
