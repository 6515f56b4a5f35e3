# Helpers for the command-line tests (tests/cli_*.cmake), which CTest runs as
# `cmake -DKEEL=<binary> -DWORK=<scratch dir> ... -P <script>`.

# Runs keel with ARGN. expect_ok TRUE: must exit 0; FALSE: must exit 2 (keel's status
# for an error it reports). Stores stdout + stderr in out_var.
function(run_keel expect_ok out_var)
  execute_process(COMMAND ${KEEL} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(expect_ok AND NOT rc EQUAL 0)
    message(FATAL_ERROR "keel ${ARGN} failed (${rc}):\n${out}${err}")
  elseif(NOT expect_ok AND NOT rc EQUAL 2)
    message(FATAL_ERROR "keel ${ARGN} should have failed with status 2, got ${rc}:\n${out}${err}")
  endif()
  set(${out_var} "${out}${err}" PARENT_SCOPE)
endfunction()

function(expect_text text pattern)
  string(FIND "${text}" "${pattern}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "expected '${pattern}' in:\n${text}")
  endif()
endfunction()
