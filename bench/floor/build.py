"""``python -m bench.floor.build DIR``: build the compiled floor server into DIR/ext_proc_floor.

Needs Debian's grpc++ toolchain (libgrpc++-dev, libprotobuf-dev, protobuf-compiler, protobuf-compiler-grpc,
g++, pkg-config; the Makefile's bench target installs them). No .proto source is fetched: the ext_proc
messages are generated from the descriptors compiled into the xds-protos wheel this Python imports,
written out as a FileDescriptorSet and handed to ``protoc --descriptor_set_in``. The well-known
``google/protobuf`` types come from libprotobuf-dev. A rebuild happens only when the source, this
script or the wheel's descriptors changed (a digest of the three is kept beside the binary); the generated
messages are compiled once per set of descriptors and kept in DIR/gen-DIGEST.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from envoy.service.ext_proc.v3 import external_processor_pb2
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "ext_proc_floor.cc"
SERVICE_PROTO = "envoy/service/ext_proc/v3/external_processor.proto"
BINARY = "ext_proc_floor"
TOOLS = ("protoc", "grpc_cpp_plugin", "g++", "pkg-config")


def descriptor_set(root: FileDescriptor) -> descriptor_pb2.FileDescriptorSet:
    """``root`` and everything it imports, dependencies first (the order protoc wants)."""
    files: list[descriptor_pb2.FileDescriptorProto] = []
    seen: set[str] = set()
    stack: list[tuple[FileDescriptor, bool]] = [(root, False)]
    while stack:
        current, expanded = stack.pop()
        if expanded:
            proto = descriptor_pb2.FileDescriptorProto()
            current.CopyToProto(proto)
            files.append(proto)
            continue
        if current.name in seen:
            continue
        seen.add(current.name)
        stack.append((current, True))
        stack.extend((dep, False) for dep in reversed(current.dependencies) if dep.name not in seen)
    return descriptor_pb2.FileDescriptorSet(file=files)


def _run(argv: list[str], cwd: Path) -> str:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:3])} ... failed:\n{done.stderr[-4000:]}")
    return done.stdout


def build(out: Path) -> Path:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: apt-get install libgrpc++-dev libprotobuf-dev "
                         "protobuf-compiler protobuf-compiler-grpc g++ pkg-config")
    descriptors = descriptor_set(external_processor_pb2.DESCRIPTOR)
    encoded = descriptors.SerializeToString(deterministic=True)
    digest = hashlib.sha256(SOURCE.read_bytes() + Path(__file__).read_bytes() + encoded).hexdigest()
    binary, stamp = out / BINARY, out / f"{BINARY}.sha256"
    if binary.exists() and stamp.exists() and stamp.read_text() == digest:
        return binary
    gen_digest = hashlib.sha256(encoded + Path(__file__).read_bytes()).hexdigest()[:16]
    work = out / f"gen-{gen_digest}"
    gen = work / "gen"
    if not (work / "objects").exists():
        shutil.rmtree(work, ignore_errors=True)
        gen.mkdir(parents=True)
        (work / "ext_proc.desc").write_bytes(encoded)
        ours = [f.name for f in descriptors.file if not f.name.startswith("google/protobuf/")]
        _run(["protoc", "--descriptor_set_in=ext_proc.desc", "--cpp_out=gen", *ours], work)
        _run(["protoc", "--descriptor_set_in=ext_proc.desc", "--grpc_out=gen",
              f"--plugin=protoc-gen-grpc={shutil.which('grpc_cpp_plugin')}", SERVICE_PROTO], work)
        generated = _compile(sorted(gen.rglob("*.cc")), gen, work)
        (work / "objects").write_text("\n".join(generated))
    objects = [*(work / "objects").read_text().split("\n"), *_compile([SOURCE], gen, work)]
    libs = _run(["pkg-config", "--libs", "grpc++", "protobuf"], work).split()
    _run(["g++", "-o", str(binary), *objects, *libs], work)
    stamp.write_text(digest)
    return binary


def _compile(sources: list[Path], gen: Path, work: Path) -> list[str]:
    """Object files for ``sources``, compiled in parallel."""
    flags = ["-O2", "-std=c++17", f"-I{gen}", *_run(["pkg-config", "--cflags", "grpc++", "protobuf"], work).split()]

    def one(source: Path) -> str:
        obj = work / (hashlib.sha256(str(source).encode()).hexdigest()[:12] + ".o")
        _run(["g++", *flags, "-c", str(source), "-o", str(obj)], work)
        return str(obj)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(one, sources))


def main(argv: list[str]) -> int:
    out = (Path(argv[1]) if len(argv) > 1 else HERE.parents[1] / ".cache" / "bench-floor").resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(build(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
