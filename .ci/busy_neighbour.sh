#!/usr/bin/env bash
# The test suite on a machine that also runs other work, as a new user would run it: the README's
# test command (the second line of its first bash block) in a fresh virtual environment, while the
# README's example job (2 ranks, a hang in step 150, a restart) runs in a loop beside it as another
# job of the same user would, with its own files in /dev/shm and the temp dir. Afterwards it checks
# that the machine is as it was: /etc/hosts and the installed system packages unchanged.
#
#   .ci/busy_neighbour.sh            # the suite once (about 20 minutes on 2 cores)
#   REPEAT=2 .ci/busy_neighbour.sh   # twice, the issue's proof
#   .ci/busy_neighbour.sh python -m pytest -q tests/jobs/test_launcher.py   # another command, same setting
#
# Unlike .ci/run it does not opt in to installing packages or editing /etc/hosts
# (FT_TEST_SYSTEM_SETUP): the SLURM and browser tests run where SLURM and chromium are already
# there and skip elsewhere, saying why. Exit status: the command's, or 3 when the machine changed.
set -uo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
work="$(mktemp -d)"
neighbour_pid=""
cleanup() {
    if [ -n "$neighbour_pid" ]; then
        kill -TERM "$neighbour_pid" 2>/dev/null
        wait "$neighbour_pid" 2>/dev/null
    fi
    rm -rf "$work"
}
trap cleanup EXIT

packages() { { dpkg-query -W -f '${Package} ${Version}\n' 2>/dev/null || rpm -qa 2>/dev/null; } | sort; }
sha256sum /etc/hosts > "$work/hosts.before"
packages > "$work/packages.before"

# The neighbour: the README's first command's job, again and again, in its own directory. Each run
# is waited for; its own run dir in the temp dir (stack and flight-recorder dumps, kept for an
# operator) is removed after it, so the loop does not fill the disk.
neighbour() {
    local launch runs=0 ok=0
    launch="$(awk '/^```bash$/ { inside = 1; next } inside && /^```/ { exit } inside' README.md | head -n 1)"
    launch="${launch##*&& ft_launcher }"
    mkdir -p "$work/neighbour"
    trap 'kill -TERM "$job" 2>/dev/null; wait "$job" 2>/dev/null; echo "$runs $ok" > "$work/neighbour.runs"; exit 0' TERM
    while true; do
        rm -rf "$work/neighbour/ckpt"
        # shellcheck disable=SC2086
        (cd "$work/neighbour" && PYTHONPATH="$root" exec python3 -m ft_launcher ${launch//examples\//$root/examples/}) \
            > "$work/neighbour/last.log" 2>&1 &
        job=$!
        wait "$job" && ok=$((ok + 1))
        runs=$((runs + 1))
        rm -rf "${TMPDIR:-/tmp}/ft_launcher-$job"
        echo "$runs $ok" > "$work/neighbour.runs"
    done
}
neighbour &
neighbour_pid=$!

python3 -m venv "$work/venv"
# shellcheck disable=SC1091
. "$work/venv/bin/activate"
if [ "$#" -gt 0 ]; then
    command=("$@")
else
    test_line="$(awk '/^```bash$/ { inside = 1; next } inside && /^```/ { exit } inside' README.md | sed -n 2p)"
    command=(bash -eo pipefail -c "$test_line")
fi
status=0
for round in $(seq "${REPEAT:-1}"); do
    echo "+ [run $round of ${REPEAT:-1}, beside the example job in a loop] ${command[*]}" >&2
    "${command[@]}" || { status=$?; echo "run $round: exit $status" >&2; break; }
done

kill -TERM "$neighbour_pid" 2>/dev/null
wait "$neighbour_pid" 2>/dev/null
neighbour_pid=""
read -r runs ok < "$work/neighbour.runs" 2>/dev/null || { runs=0; ok=0; }
echo "neighbour: the example job ran $runs time(s) beside it, $ok ended 0" >&2

changed=0
if ! sha256sum --quiet -c "$work/hosts.before" >/dev/null 2>&1; then
    echo "CHANGED: /etc/hosts" >&2
    changed=1
fi
packages > "$work/packages.after"
if ! cmp -s "$work/packages.before" "$work/packages.after"; then
    echo "CHANGED: installed system packages:" >&2
    diff "$work/packages.before" "$work/packages.after" | head -20 >&2
    changed=1
fi
[ "$changed" = 0 ] && echo "unchanged: /etc/hosts and the installed system packages" >&2
if [ "$status" != 0 ]; then
    exit "$status"
fi
exit $((changed * 3))
