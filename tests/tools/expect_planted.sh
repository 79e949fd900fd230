#!/usr/bin/env bash
# expect_planted.sh FAULT PATTERN COMMAND...: runs COMMAND with KMOE_FAULT=FAULT (a bug planted
# in kmoe itself, src/core/fault_injection.hpp) and passes only when the command fails and its
# output names what the fault broke (PATTERN, an extended regex): the check under test catches
# the bug, and for the right reason.
set -uo pipefail
[ $# -ge 3 ] || { echo "usage: expect_planted.sh FAULT PATTERN COMMAND..." >&2; exit 2; }
fault=$1 pattern=$2
shift 2
out=$(KMOE_FAULT=$fault "$@" 2>&1)
rc=$?
if [ $rc -eq 0 ]; then
  echo "$out" | tail -20
  echo "FAIL with KMOE_FAULT=$fault the check passed: it does not catch the planted bug"
  exit 1
fi
if ! echo "$out" | grep -Eq "$pattern"; then
  echo "$out" | tail -30
  echo "FAIL with KMOE_FAULT=$fault the check failed (exit $rc) without naming /$pattern/"
  exit 1
fi
echo "$out" | grep -E "$pattern" | head -3
echo "ok   KMOE_FAULT=$fault: the check fails (exit $rc) and names /$pattern/"
