# Registers the Catch2 cases of one test binary with ctest, in three groups
# by tag, after each build of it (run by trainer_test in tests/CMakeLists.txt):
#   default  "~[slow]~[cuda]"  as "<case name>"
#   slow     "[slow]~[cuda]"   as "slow:<case name>", label slow
#   cuda     "[cuda]"          as "cuda:<case name>", label cuda; exit code 77 = skipped
# It does what Catch2's catch_discover_tests does once per group, but a group
# with no cases is normal here (most binaries have no [slow] or [cuda] case),
# so it is not reported as a warning on every build.
#
#   cmake -D TEST_EXECUTABLE=... -D TEST_WORKING_DIR=... -D CTEST_FILE=... -P catch_add_tests.cmake

set(script "")

# add_test/set_tests_properties lines with every argument bracket-quoted.
function(add_command name)
  set(args "")
  foreach(arg IN LISTS ARGN)
    string(APPEND args " [==[${arg}]==]")
  endforeach()
  set(script "${script}${name}(${args})\n" PARENT_SCOPE)
endfunction()

function(add_group spec prefix)
  execute_process(
    COMMAND "${TEST_EXECUTABLE}" ${spec} --list-test-names-only
    OUTPUT_VARIABLE output
    RESULT_VARIABLE result
    WORKING_DIRECTORY "${TEST_WORKING_DIR}")
  # Catch2 v2 exits with the number of cases listed; anything else is a crash.
  if(NOT result MATCHES "^[0-9]+$")
    message(FATAL_ERROR "cannot list the tests of ${TEST_EXECUTABLE}: ${result}\n${output}")
  endif()
  # A ';' would split a name in two (CMake lists): ctest would run a spec
  # matching no case, which passes without testing anything.
  if(output MATCHES ";")
    string(REGEX MATCH "[^\n]*;[^\n]*" bad "${output}")
    message(FATAL_ERROR "${TEST_EXECUTABLE}: the test case \"${bad}\" has a ';' in its name; "
                        "ctest cannot register it (use a comma)")
  endif()
  string(REPLACE "\n" ";" names "${output}")
  foreach(name IN LISTS names)
    if(name STREQUAL "")
      continue()
    endif()
    # Catch2 reads ',', '[' and ']' in a test spec as syntax.
    set(spec_name "${name}")
    foreach(char , [ ])
      string(REPLACE "${char}" "\\${char}" spec_name "${spec_name}")
    endforeach()
    add_command(add_test "${prefix}${name}" "${TEST_EXECUTABLE}" "${spec_name}")
    add_command(set_tests_properties "${prefix}${name}" PROPERTIES
                WORKING_DIRECTORY "${TEST_WORKING_DIR}" ${ARGN})
  endforeach()
  set(script "${script}" PARENT_SCOPE)
endfunction()

add_group("~[slow]~[cuda]" "")
add_group("[slow]~[cuda]" "slow:" LABELS slow)
add_group("[cuda]" "cuda:" LABELS cuda SKIP_RETURN_CODE 77)
file(WRITE "${CTEST_FILE}" "${script}")
