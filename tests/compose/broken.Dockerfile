# The compose stage's deliberately broken image (tests/compose/broken-image.yaml): the image the stage
# built, without the hpack package, so `pd-extproc serve` exits at start with ModuleNotFoundError.
ARG IMAGE=pd-extproc:0.1.0
FROM ${IMAGE}
USER 0
RUN rm -r /opt/pd-extproc/lib/python3*/site-packages/hpack
USER 10001:10001
