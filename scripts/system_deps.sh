#!/usr/bin/env bash
# Installs the OS packages that the multi-host tests use: iproute2 (network namespaces, veth,
# bridge), openssh-server (one sshd per test host), pdsh (DeepSpeed's launcher in benchmarks) and
# slurm-wlm + munge (SLURM's own tools: hostlists are checked against scontrol), openmpi-bin (a bare
# mpirun starts ranks that find each other through init_distributed). Only as root; otherwise the cluster tests
# skip and say why. Services are never started by the install (policy-rc.d exits 101).
set -euo pipefail
if [ "$(id -u)" != 0 ]; then
    echo "system_deps: not root, skipping OS packages (cluster tests will skip)"
    exit 0
fi
need=()
command -v ip >/dev/null || need+=(iproute2)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v pdsh >/dev/null || need+=(pdsh)
command -v scontrol >/dev/null || need+=(slurm-wlm munge)
command -v mpirun >/dev/null || need+=(openmpi-bin)
[ ${#need[@]} -eq 0 ] && exit 0
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
echo "system_deps: installed ${need[*]}"
