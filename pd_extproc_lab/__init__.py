"""The lab: emulated inference engines, the demo stack (`pd-extproc up`) and its process supervisor.

Tests, the demo and the benchmark use it; the product's request path never imports it (the layout
test in tests/unit/test_layout.py holds that). Its own dependencies are the `lab` extra:
`pip install 'pd-extproc[lab]'`.
"""
