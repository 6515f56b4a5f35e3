# End to end through the command line: `keel synth` writes a checkpoint, `keel inspect`
# reads it back; a truncated copy and a missing directory fail with errors that name
# the file. Run by CTest with -DKEEL=<binary> -DWORK=<scratch dir>.
file(REMOVE_RECURSE ${WORK})

include(${CMAKE_CURRENT_LIST_DIR}/cli_common.cmake)

run_keel(TRUE out synth --shape tiny --seed 2 --out ${WORK}/tiny)
expect_text("${out}" "tensors")
run_keel(TRUE out inspect --model ${WORK}/tiny)
expect_text("${out}" "expected tensors present with the expected shapes and dtypes (MTP layer included)")
expect_text("${out}" "F8_E8M0")

# A shard cut short (its last tensor loses 100 bytes): the error names the file.
file(MAKE_DIRECTORY ${WORK}/truncated)
file(COPY ${WORK}/tiny/config.json DESTINATION ${WORK}/truncated)
file(SIZE ${WORK}/tiny/model.safetensors size)
math(EXPR cut "${size} - 100")
execute_process(COMMAND head -c ${cut} ${WORK}/tiny/model.safetensors
                OUTPUT_FILE ${WORK}/truncated/model.safetensors)
run_keel(FALSE out inspect --model ${WORK}/truncated)
expect_text("${out}" "truncated/model.safetensors")
expect_text("${out}" "[out_of_bounds]")

run_keel(FALSE out inspect --model ${WORK}/does-not-exist)
expect_text("${out}" "does-not-exist")
run_keel(FALSE out synth --shape huge --out ${WORK}/x)
expect_text("${out}" "unknown shape 'huge'")
