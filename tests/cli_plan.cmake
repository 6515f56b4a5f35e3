# `keel plan` end to end: the plan of a synthesized tiny checkpoint (config.json only is
# read) as a table and as JSON for several architectures, a Flash-shaped plan from the
# preset, the kernel listing, and the errors (exit status 2) for an explicit choice that
# cannot run and for bad arguments. Run by CTest with -DKEEL=<binary> -DWORK=<scratch dir>.
file(REMOVE_RECURSE ${WORK})

include(${CMAKE_CURRENT_LIST_DIR}/cli_common.cmake)

function(expect_equal actual expected what)
  if(NOT "${actual}" STREQUAL "${expected}")
    message(FATAL_ERROR "${what}: expected '${expected}', got '${actual}'")
  endif()
endfunction()

run_keel(TRUE out synth --shape tiny --seed 3 --out ${WORK}/tiny)
# Only config.json is needed: plan a directory that has nothing else.
file(MAKE_DIRECTORY ${WORK}/config-only)
file(COPY ${WORK}/tiny/config.json DESTINATION ${WORK}/config-only)

run_keel(TRUE out plan --model ${WORK}/config-only --arch cpu)
expect_text("${out}" "arch cpu (--arch)")
expect_text("${out}" "kernel plan for cpu: 5 target layers, 1 draft (MTP) layer")
expect_text("${out}" "target  layers 0-4")
expect_text("${out}" "draft   mtp.0")

# JSON: every entry has the documented keys; the tiny preset's first entry is the target
# embedding (bf16) and the last the draft's MoE (MXFP4 experts) in MTP layer 5.
run_keel(TRUE json plan --model ${WORK}/config-only --arch cpu --json)
string(JSON n LENGTH "${json}" entries)
expect_equal("${n}" "68" "entries of the tiny plan")
string(JSON op GET "${json}" entries 0 op)
expect_equal("${op}" "embedding" "first op")
string(JSON fmt GET "${json}" entries 0 formats 0)
expect_equal("${fmt}" "bf16" "embedding format")
math(EXPR last "${n} - 1")
foreach(key layer role op kernel reason)
  string(JSON value GET "${json}" entries ${last} ${key})
  set(last_${key} "${value}")
endforeach()
expect_equal("${last_layer}/${last_role}/${last_op}/${last_kernel}" "5/draft/moe_gemm/cpu" "last entry")
string(JSON arch GET "${json}" entries ${last} archs 0)
expect_equal("${arch}" "cpu" "archs of the cpu kernel")
string(JSON fmt GET "${json}" entries ${last} formats 0)
expect_equal("${fmt}" "mxfp4" "draft expert format")

# A draft quantized differently: the MTP layer's experts in NVFP4.
run_keel(TRUE json plan --model ${WORK}/tiny --arch cpu --json --draft-expert-format nvfp4)
string(JSON fmt GET "${json}" entries ${last} formats 0)
expect_equal("${fmt}" "nvfp4" "--draft-expert-format")

# Every GPU architecture gives a plan or, where this binary has no kernel for an op, an
# error at plan time that names the op and the architecture.
foreach(arch sm_80 sm_86 sm_89 sm_90 sm_100 sm_103 sm_120 sm_121)
  execute_process(COMMAND ${KEEL} plan --model ${WORK}/tiny --arch ${arch} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(rc EQUAL 0)
    expect_text("${out}" "kernel plan for ${arch}:")
  elseif(rc EQUAL 2)
    expect_text("${err}" "no kernel plan for ${arch}:")
    expect_text("${err}" "[kernel_plan]")
  else()
    message(FATAL_ERROR "keel plan --arch ${arch}: status ${rc}\n${out}${err}")
  endif()
endforeach()

# The seed case's failure: an explicit MoE choice that cannot run on sm_120, for the
# target and for the draft that follows it; no fallback, status 2.
run_keel(FALSE out plan --model ${WORK}/tiny --arch sm_120 --moe-backend cpu)
expect_text("${out}" "target layers 0-4: moe_gemm (mxfp4) on sm_120: --moe-backend 'cpu' runs on cpu only")
expect_text("${out}" "draft mtp.0: moe_gemm (mxfp4) on sm_120: --moe-backend 'cpu' (which the draft follows) runs on cpu only")
expect_text("${out}" "change --draft-moe-backend (or --moe-backend for both roles)")
run_keel(FALSE out plan --model ${WORK}/tiny --arch cpu --moe-backend cpu --draft-moe-backend nope)
expect_text("${out}" "field '--draft-moe-backend': no kernel named 'nope' in this binary")
run_keel(FALSE out plan --model ${WORK}/tiny --arch sm_999)
expect_text("${out}" "unknown architecture 'sm_999'")
run_keel(FALSE out plan --model ${WORK}/tiny --arch cpu --draft-expert-format fp6)
expect_text("${out}" "unknown weight format 'fp6'")
run_keel(FALSE out plan --model ${WORK}/tiny --shape flash)
expect_text("${out}" "give exactly one of --model DIR and --shape NAME")
run_keel(FALSE out plan --model ${WORK}/does-not-exist --arch cpu)
expect_text("${out}" "does-not-exist")

# A Flash-shaped plan from the preset, without writing the checkpoint: 43 trunk layers,
# the MTP layer is layer 43.
run_keel(TRUE out plan --shape flash --arch cpu)
expect_text("${out}" "kernel plan for cpu: 43 target layers, 1 draft (MTP) layer")
expect_text("${out}" "target  layers 2,4,..,42")
run_keel(TRUE json plan --shape flash --arch cpu --json)
string(JSON n LENGTH "${json}" entries)
math(EXPR last "${n} - 1")
string(JSON layer GET "${json}" entries ${last} layer)
expect_equal("${layer}" "43" "last layer of the Flash plan")
# The expert-parallel split over 2 hosts of 2 GPUs.
run_keel(TRUE out plan --shape flash --arch cpu --gpus 2 --hosts 2)
expect_text("${out}" "expert parallel over 4 GPUs (2 hosts of 2)")
expect_text("${out}" "rank 3: host 1 GPU 1, 64 of 256 routed experts per layer (3,7,11,..,255)")

run_keel(TRUE out plan --list-kernels)
expect_text("${out}" "moe_gemm")
run_keel(TRUE json plan --list-kernels --json)
string(JSON name GET "${json}" kernels 0 name)
expect_equal("${name}" "cpu" "first kernel")
string(JSON op GET "${json}" kernels 0 op)
expect_equal("${op}" "embedding" "first kernel's op")

# With the CUDA kernels in the binary: prefill attention on the tensor cores; decode and
# verify on the f32 kernel in every layer, the same kernel for both, so that a verified
# draft row gets the bits plain decoding gets (speculative decoding gives the plain
# tokens); the draft's (sliding) layer likewise.
run_keel(TRUE out plan --list-kernels)
if(out MATCHES "cuda_mma_attention")
  run_keel(TRUE out plan --shape flash --arch sm_90)
  foreach(want "target +layers 0-42 +attention_prefill +- +cuda_mma_attention "
               "target +layers 0-42 +attention_decode +- +cuda_decode_attention "
               "target +layers 0-42 +attention_verify +- +cuda_decode_attention "
               "draft +mtp.0 +attention_prefill +- +cuda_mma_attention "
               "draft +mtp.0 +attention_decode +- +cuda_decode_attention ")
    if(NOT out MATCHES "${want}")
      message(FATAL_ERROR "the sm_90 Flash plan has no line matching '${want}':\n${out}")
    endif()
  endforeach()
endif()
