# rankguard's two images, from this repository's own wheel:
#   docker build --target agent -t rankguard-agent:0.1.0 .       the node agent: no torch
#   docker build --target supervisor -t rankguard:0.1.0 .        the supervisor, the rendezvous
#                                                                store and the CLI (CPU torch)
# `rankguard deploy kubernetes` names them in agent.image and supervisor.image.
ARG PYTHON=python:3.11-slim

FROM ${PYTHON} AS wheel
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir "build>=1" && python -m build --wheel --outdir /dist

# The agent runs as root in its pod with only CAP_KILL and CAP_SYS_PTRACE (it signals and
# reads training workers of every user); NVML comes from the NVIDIA container toolkit.
FROM ${PYTHON} AS agent
COPY --from=wheel /dist/ /tmp/dist/
RUN pip install --no-cache-dir /tmp/dist/*.whl && rm -rf /tmp/dist
ENTRYPOINT ["rankguard"]
CMD ["agent", "--help"]

# torch for the rendezvous store (a TCPStore): the CPU build, a fraction of the CUDA one;
# the Kubernetes client for the supervisor's node backend.
FROM ${PYTHON} AS supervisor
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY --from=wheel /dist/ /tmp/dist/
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" torch \
    && pip install --no-cache-dir "$(ls /tmp/dist/*.whl)[kubernetes]" && rm -rf /tmp/dist \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin rankguard
USER 10001
ENTRYPOINT ["rankguard"]
CMD ["supervisor", "--help"]
