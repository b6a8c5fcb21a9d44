"""Train-style loading of JPEGs from an HTTP server with 32 worker threads and a disk cache.

Run::

    pip install threadloader[images]            # Pillow, to make and decode the JPEGs
    python examples/remote_images.py            # ~5 s on 2 cores

It starts a local HTTP server (a stand-in for object storage) that answers each request after
10 ms, with 1,024 small JPEGs, then runs two epochs of
``ThreadDataLoader(RemoteFiles(urls, decode=..., cache_dir=...), batch_size=16, num_workers=32)``
with the cache in a temporary directory, removed at the end.
For a real bucket, pass ``"s3://bucket/prefix/*.jpg"`` and ``storage_options`` instead of URLs.

Result (2-core machine shared with other jobs; three runs gave epoch 1 in 1.5-3.2 s)::

    epoch 1: 1024 images in 1.48 s (690/s)  from the server
    epoch 2: 1024 images in 0.64 s (1,611/s)  from the cache
    RemoteStats(reads=1024, read_bytes=10149636, ..., cache_hits=1024, cache_misses=1024, ...)

(If ``isolation="auto"`` moves epoch 2's workers into helper processes, the counters are the
helpers': ``reads=0, ..., cache_hits=1024, cache_misses=0``.)

Why: epoch 1 waits on the network and writes the cache; 32 threads plus each batch's concurrent
reads keep dozens of requests in flight for a few megabytes (32 worker processes: gigabytes).
Here the server runs in the same process and competes for the GIL, and creating 1,024 cache files
is slow on this machine's disk, so epoch 1 is far from the 10 ms latency limit (see
``bench/bench_remote.py`` for that). Epoch 2 reads local files: what remains is JPEG decoding,
which Pillow does with the GIL released, so the threads decode in parallel.
"""

from __future__ import annotations

import io
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch

try:
    from PIL import Image
except ImportError:
    sys.exit("examples/remote_images.py needs Pillow: pip install threadloader[images]")

from threadloader import ThreadDataLoader
from threadloader.remote import RemoteFiles

IMAGES = 1024
LATENCY_S = 0.010


def make_jpegs(n: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        pixels = rng.integers(0, 256, size=(96, 128, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def serve(objects: list[bytes]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # else each answer waits ~40 ms for a delayed ACK

        def do_GET(self) -> None:
            time.sleep(LATENCY_S)
            body = objects[int(self.path.rsplit("/", 1)[1])]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="example-server").start()
    return server


def decode(data: bytes) -> torch.Tensor:
    """JPEG bytes -> float CHW tensor in [0, 1]."""
    with Image.open(io.BytesIO(data)) as img:
        array = np.array(img.convert("RGB"), dtype=np.uint8)  # a writable copy
    return torch.from_numpy(array).permute(2, 0, 1).float().div_(255)


def main() -> None:
    server = serve(make_jpegs(IMAGES))
    port = server.server_address[1]
    urls = [f"http://127.0.0.1:{port}/images/{i}" for i in range(IMAGES)]
    try:
        with (
            tempfile.TemporaryDirectory() as cache,
            RemoteFiles(urls, decode=decode, cache_dir=cache) as dataset,
        ):
            loader = ThreadDataLoader(dataset, batch_size=16, shuffle=True, num_workers=32)
            for epoch, source in ((1, "from the server"), (2, "from the cache")):
                start, seen = time.perf_counter(), 0
                for batch in loader:
                    seen += batch.shape[0]
                elapsed = time.perf_counter() - start
                print(
                    f"epoch {epoch}: {seen} images in {elapsed:.2f} s "
                    f"({seen / elapsed:,.0f}/s)  {source}"
                )
            # The epoch's reads as counted where they ran: in this process, or in helper
            # processes if isolation="auto" moved the workers there for epoch 2.
            print(loader.stats().dataset)
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
