#!/usr/bin/env bash
# Install paratrain into the current Python.
#   bash scripts/setup.sh         # the library and the `paratrain` command
#   bash scripts/setup.sh test    # ... plus what the test suite needs, the peers' configs included
# torch: an installed torch (e.g. the CUDA build on a GPU machine) is left alone; where none
# is installed we ask for torch==2.13.0, which on our CPU machines resolves to the local CPU
# wheel. Every later install is constrained to the torch that is present, so pip can never
# swap it for a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
extra=${1:-}

if ! "$py" -c "import torch" 2>/dev/null; then
  echo "paratrain setup: no torch found, installing torch==2.13.0"
  "$py" -m pip install --quiet torch==2.13.0
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$py" -c "import torch; print('torch==' + torch.__version__)" > "$constraints"
echo "paratrain setup: using $(cat "$constraints")"

target="."
[ -n "$extra" ] && target=".[$extra]"
# The tests read `plan --emit`'s configs with torchtitan's, Megatron's and DeepSpeed's own
# parsers (the `peers` extra); torchtitan without its trainer's requirements (pyproject.toml).
if [ "$extra" = "test" ]; then target=".[test,peers]"; fi
"$py" -m pip install --quiet -c "$constraints" -e "$target"
if [ "$extra" = "test" ]; then
  "$py" -m pip install --quiet --no-deps torchtitan==0.2.2
fi
# tests/test_slurm.py submits jobs to a one-node Slurm it starts (scripts/slurm/local_cluster.py):
# Debian's slurm-wlm (slurmctld, slurmd, the clients) and munge, installed where we are root
# with apt-get; elsewhere those tests skip and say why.
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
if [ "$extra" = "test" ] && ! { have slurmctld && have slurmd && have sbatch && have munged; } \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "paratrain setup: installing slurm-wlm and munge (apt-get) for the Slurm tests"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y --no-install-recommends slurm-wlm munge >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; }; } \
    || echo "paratrain setup: could not install slurm-wlm and munge; the Slurm tests will skip"
fi
# pyenv only exposes new console scripts after a rehash.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
echo "paratrain setup: done ($("$py" -m paratrain --version))"
