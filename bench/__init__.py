"""The P/D benchmark: pd-extproc against direct decode, plain Envoy and vllm-router, on one machine.

Run it with ``make bench``. Every system under test talks to the same two emulated workers (one
prefill, one decode), the load generator is wrk, and the measurement points of all systems are
interleaved round by round so machine noise falls on all of them alike. See bench/RESULTS.md.
"""
