#!/usr/bin/env bash
# The project's GPU check (benchmarks/gpu_check.py): every method on the GPU for 2 rounds with amp off and on, a
# repeat for reproducibility, a paper-size model, CPU vs GPU evaluation, amp and local-round speed; PASS / FAIL
# lines, written to benchmarks/results/gpu_check_<device>.{md,json} (--out DIR to change).
#
#   bash benchmarks/gpu_check.sh                         # from the checkout root, on a GPU machine
#   bash benchmarks/gpu_check.sh --device cpu --quick --budget 1500   # a dry run on a CPU
#
# No network is needed. The Python is the first of these whose torch sees CUDA (with --device cpu: whose torch
# imports): $GPU_CHECK_PYTHON, python3 on the PATH, the checkout's .venv. A Python that lacks MONAI borrows it
# (appended after its own packages: its CUDA torch and numpy win) from .venv/gpu_deps.zip, written on a machine
# that has the project's venv by `python benchmarks/gpu_check.py --pack-deps` (1.6 MB, pure Python), or from a
# copied .venv's site-packages. Without NVFlare (its gRPC is compiled per Python version) the simulator job and
# FedProx (NVFlare's loss) report SKIP with the reason.
set -u
cd "$(dirname "$0")/.."

candidates=()
[ -n "${GPU_CHECK_PYTHON:-}" ] && candidates+=("$GPU_CHECK_PYTHON")
command -v python3 >/dev/null 2>&1 && candidates+=("$(command -v python3)")
[ -x .venv/bin/python ] && candidates+=(".venv/bin/python")

want_cuda=1
for arg in "$@"; do
  case "$arg" in --device=cpu|cpu) want_cuda=0 ;; esac
done

chosen=""
for py in "${candidates[@]}"; do
  probe=$("$py" -c "import torch; print(torch.__version__, torch.cuda.is_available())" 2>&1 | tail -n 1)
  echo "python candidate $py: $probe"
  if [ -z "$chosen" ]; then
    case "$probe" in
      *" True") chosen="$py" ;;
      *" False") [ "$want_cuda" = 0 ] && chosen="$py" ;;
    esac
  fi
done

if [ -z "$chosen" ]; then
  echo "FAIL gpu check: no Python with a CUDA torch among: ${candidates[*]:-none} (set GPU_CHECK_PYTHON, or pass --device cpu for a dry run)"
  exit 2
fi
echo "using $chosen"
exec "$chosen" benchmarks/gpu_check.py "$@"
