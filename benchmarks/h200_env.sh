# Sourced by the h200_*.sh scripts on a lent GPU machine (.wheels carried): $OUT made, the DeepSpeed wheels
# installed, the environment every GPU run needs (../shared/device/README.md: TORCH_CUDA_ARCH_LIST=9.0 for
# DeepSpeed's op builder, NVLink multicast off) exported, the machine's GPUs and cores in $OUT/machine.txt, and
# `build_ops [dc]`, which builds DeepSpeed's FusedAdam (with `dc`: also DeepCompile's extension) once, before any
# timed run. H200_FUNCS_ONLY=1 defines build_ops and nothing else.
build_ops() {  # [dc]; prints "ops ready" once they load
    local extra=""
    [ "${1:-}" = dc ] && extra="; from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load()"
    timeout 300 python3 -c "from deepspeed.accelerator import get_accelerator as a; \
a().create_op_builder('FusedAdamBuilder').load()$extra; print('ops ready')" 2>&1 | tail -n 1
}
[ -n "${H200_FUNCS_ONLY:-}" ] && return 0  # build_ops only (h200_issue12.sh sets up the rest itself)

OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps .wheels/*.whl 2>&1 | tail -2
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 \
       TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_EXTENSIONS_DIR=$PWD/.torch_extensions
{ nvidia-smi --query-gpu=name,clocks.max.sm --format=csv; nproc; } > "$OUT/machine.txt" 2>&1
