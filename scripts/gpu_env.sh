# Source at the start of a command on the lent GPU machine (docs/gpu.md): the carried wheels of .gpu
# (../shared/tools/gpu-carry.sh; installed into /tmp/site, which stays while the machine is warm), then
# deepinfer and its plugins installed editable (their entry points), with the checkout first on sys.path.
if [ -f .gpu/setup.sh ]; then source .gpu/setup.sh || return 1; fi
[ -d /tmp/site ] || { echo "gpu_env: carry .gpu in the first call of a lease" >&2; return 1; }
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . plugins/* > /tmp/pip-dev.log 2>&1 \
  || { tail -5 /tmp/pip-dev.log; return 1; }
PYTHONPATH=$PWD:$(printf '%s:' "$PWD"/plugins/*)/tmp/site
export PYTHONPATH PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# A compile cache brought back from an earlier session (scripts/inductor_cache.sh pack $OUT, files copied into
# .inductor/ and carried): Inductor's start-up then skips code generation.
if compgen -G ".inductor/inductor.tgz.*" > /dev/null; then
  bash scripts/inductor_cache.sh unpack .inductor
fi
