# llmtrain image, two flavours from one file.
#
# GPU clusters (the default): built in NVIDIA's CUDA devel image (cuDNN, NCCL included), run in
# the runtime one.
#   docker build -t llmtrain .
#   docker run --gpus all --rm llmtrain info
#   docker run --gpus all --rm -v $PWD/runs:/runs llmtrain train --config /opt/llmtrain/configs/tiny.json --run-dir /runs/tiny
# Multi-GPU on one node (one process per GPU):
#   docker run --gpus all --rm --entrypoint mpirun llmtrain -np 8 llmtrain train --config ...
#
# CPU only: a plain Debian base (any image of a Debian release, e.g. debian:bookworm-20250520, or
# one made with debootstrap and `podman import`), built with -DLLMTRAIN_CUDA=OFF:
#   docker build -t llmtrain-cpu --build-arg BUILD_IMAGE=debian:bookworm-20250520 \
#     --build-arg RUNTIME_IMAGE=debian:bookworm-20250520 --build-arg LLMTRAIN_CUDA=OFF \
#     --build-arg MPI_LIBRARY=libopenmpi3 .
# (tests/container_test.sh builds and runs it with podman.)
ARG CUDA_IMAGE_TAG=13.0.0-cudnn
ARG BUILD_IMAGE=nvidia/cuda:${CUDA_IMAGE_TAG}-devel-ubuntu24.04
ARG RUNTIME_IMAGE=nvidia/cuda:${CUDA_IMAGE_TAG}-runtime-ubuntu24.04

FROM ${BUILD_IMAGE} AS build
ARG LLMTRAIN_CUDA=ON
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      build-essential cmake git libcli11-dev nlohmann-json3-dev libopenmpi-dev openmpi-bin libopenblas0-openmp \
      libopenblas-dev libpcre2-dev zlib1g-dev libzstd-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF -DLLMTRAIN_CUDA=${LLMTRAIN_CUDA} \
    && cmake --build build -j "$(nproc)" --target llmtrain

FROM ${RUNTIME_IMAGE}
# The Open MPI library's package: libopenmpi3t64 on Ubuntu 24.04, libopenmpi3 on Debian 12.
ARG MPI_LIBRARY=libopenmpi3t64
# openssh: Open MPI's launcher reaches the other nodes' containers over ssh (multi-node runs).
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      openmpi-bin ${MPI_LIBRARY} libopenblas0-openmp libpcre2-8-0 zlib1g openssh-client openssh-server \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 llmtrain \
    && mkdir -p /home/llmtrain/.ssh /home/llmtrain/sshd \
    && printf 'Port 2222\nHostKey /home/llmtrain/sshd/host_key\nPidFile /home/llmtrain/sshd/sshd.pid\nPasswordAuthentication no\nAuthorizedKeysFile /run/secrets/llmtrain_authorized_keys\n' \
         > /home/llmtrain/sshd/sshd_config \
    && printf 'Host *\n  Port 2222\n  IdentityFile /run/secrets/llmtrain_ssh_key\n  StrictHostKeyChecking accept-new\n' \
         > /home/llmtrain/.ssh/config \
    && chown -R llmtrain:llmtrain /home/llmtrain
COPY --from=build /src/build/src/llmtrain /usr/local/bin/llmtrain
COPY --from=build /src/configs /opt/llmtrain/configs
# No host key in any layer: llmtrain-sshd generates one when the container starts (or copies the
# mounted secret llmtrain_host_key). mpirun.sh turns a SIGTERM to the launcher into exit 75.
COPY scripts/launch/container-sshd.sh /usr/local/bin/llmtrain-sshd
COPY scripts/launch/mpirun.sh /opt/llmtrain/launch/mpirun.sh
USER llmtrain
WORKDIR /home/llmtrain
ENTRYPOINT ["llmtrain"]
CMD ["info"]
# Multi-node: on every node but the first, run the ssh daemon as the non-root user, keys mounted
# as secrets (never baked into the image); its host key is made when the container starts, or
# taken from the secret llmtrain_host_key:
#   docker run --gpus all --network host -v keys:/run/secrets:ro --entrypoint llmtrain-sshd llmtrain
# and on the first node launch mpirun with a hostfile naming the nodes (see docs/clusters.md).
