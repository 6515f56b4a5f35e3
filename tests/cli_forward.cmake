# The forward-pass commands end to end: `keel logits` (full and --decode) on a fixture,
# `keel run` greedy, sampled and speculative on a synthesized FP8/MXFP4 model, and the errors for
# bad input. Run by CTest with -DKEEL=<binary> -DWORK=<scratch dir> -DFIXTURES=<dir>.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})

include(${CMAKE_CURRENT_LIST_DIR}/cli_common.cmake)

# logits: 3 tokens x 97 float32 after a 128-byte header, full forward and --decode.
file(WRITE ${WORK}/ids.txt "5, 17 3\n")
run_keel(TRUE out logits --model ${FIXTURES}/tiny --ids ${WORK}/ids.txt --out ${WORK}/full.npy)
expect_text("${out}" "[3, 97] float32")
file(SIZE ${WORK}/full.npy size)
if(NOT size EQUAL 1292)  # 128 + 3 * 97 * 4
  message(FATAL_ERROR "full.npy has ${size} bytes")
endif()
file(READ ${WORK}/full.npy header OFFSET 10 LIMIT 70)
expect_text("${header}" "'descr': '<f4', 'fortran_order': False, 'shape': (3, 97)")
run_keel(TRUE out logits --model ${FIXTURES}/tiny --ids ${WORK}/ids.txt --out ${WORK}/decode.npy --decode)

# run: greedy twice gives the same ids; sampling with a seed is repeatable.
run_keel(TRUE out synth --shape tiny --seed 4 --out ${WORK}/model)
run_keel(TRUE greedy1 run --model ${WORK}/model --prompt-ids "1,2,3" -n 12 -q)
run_keel(TRUE greedy2 run --model ${WORK}/model --prompt-ids "1 2 3" -n 12 -q)
expect_text("${greedy1}" "generated 12 tokens")
string(REGEX MATCH "^[0-9 ]+" ids1 "${greedy1}")
string(REGEX MATCH "^[0-9 ]+" ids2 "${greedy2}")
if(NOT ids1 STREQUAL ids2 OR ids1 STREQUAL "")
  message(FATAL_ERROR "greedy runs differ: '${ids1}' vs '${ids2}'")
endif()
run_keel(TRUE s1 run --model ${WORK}/model --prompt-ids "1 2 3" -n 12 -q --temperature 1 --top-p 0.9 --seed 7)
run_keel(TRUE s2 run --model ${WORK}/model --prompt-ids "1 2 3" -n 12 -q --temperature 1 --top-p 0.9 --seed 7)
string(REGEX MATCH "^[0-9 ]+" s1 "${s1}")
string(REGEX MATCH "^[0-9 ]+" s2 "${s2}")
if(NOT s1 STREQUAL s2)
  message(FATAL_ERROR "seeded sampling differs: '${s1}' vs '${s2}'")
endif()
# run --speculative: the MTP layer drafts, the trunk decides: the same seeded ids.
run_keel(TRUE spec run --model ${WORK}/model --prompt-ids "1 2 3" -n 12 -q --temperature 1 --top-p 0.9 --seed 7
         --speculative 2)
expect_text("${spec}" "[speculative: 2 drafts per step")
string(REGEX MATCH "^[0-9 ]+" spec_ids "${spec}")
if(NOT spec_ids STREQUAL s1)
  message(FATAL_ERROR "speculative decoding changed the ids: '${spec_ids}' vs '${s1}'")
endif()
run_keel(FALSE out run --model ${WORK}/model --prompt-ids "1 2 3" -q --speculative 4)
expect_text("${out}" "draft tokens must be in 1 .. 3")
run_keel(TRUE out run --model ${WORK}/model --prompt-ids "1 2 3" -n 2)
expect_text("${out}" "loaded")

# Bad input: clear errors, exit status 2.
run_keel(FALSE out run --model ${WORK}/model --prompt-ids "1 5000" -q)
expect_text("${out}" "token id 5000 at index 1 is outside the vocabulary [0, 1024)")
run_keel(FALSE out run --model ${WORK}/model --prompt-ids "1 x" -q)
expect_text("${out}" "'x' is not a token id")
run_keel(FALSE out run --model ${WORK}/model --prompt "hello" -q)
expect_text("${out}" "has no tokenizer")
run_keel(FALSE out run --model ${WORK}/model --prompt-ids " " -q)
expect_text("${out}" "no tokens to run")
run_keel(FALSE out run --model ${WORK}/model --prompt-ids "1" --top-p 0 -q)
expect_text("${out}" "top_p")
run_keel(FALSE out run --model ${WORK}/model --prompt-ids "1" -q --moe-backend no-such-kernel)
expect_text("${out}" "no-such-kernel")
file(WRITE ${WORK}/empty.txt "\n")
run_keel(FALSE out logits --model ${FIXTURES}/tiny --ids ${WORK}/empty.txt --out ${WORK}/x.npy)
expect_text("${out}" "no token ids")
