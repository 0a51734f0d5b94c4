"""The floors our server is measured against, both behind our own Envoy bootstrap (route pd, ext_proc on):

  floor-aio   ``python -m bench.floor.aio``: a grpc.aio ext_proc servicer that does nothing (our transport's
              floor: the same grpcio, uvloop, server options and Unix socket as ``pd-extproc serve``)
  floor-cxx   ``ext_proc_floor`` (ext_proc_floor.cc, built by ``python -m bench.floor.build``): the same
              nothing, compiled with grpc++'s callback API (the design's floor)

Both answer the headers message with a continue and the body message with the same body as a body
mutation with its content-length set, so Envoy sends and receives the messages it does for a P/D request.

floor-aio's variants (``--variant shape|delay|burn``, bench/floor/aio.py) price Envoy's share: our exact body
reply (replies.py), a held body, our own work's CPU spun on the loop.
"""
