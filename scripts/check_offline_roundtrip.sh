#!/usr/bin/env bash
# Prove the offline installation on this machine: gather a bundle (this step needs the package index), copy it
# as a room would receive it, install from the copy with no network, then run the workbook offline: generate
# text, reset a notebook, run one notebook in smoke mode. Not part of `make test` (it downloads ~0.5 GB).
#
#   bash scripts/check_offline_roundtrip.sh        # KEEP=1 keeps the temporary folder, NOTEBOOK=0 skips nbval
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/labkit-offline.XXXXXX")
cleanup() { if [ "${KEEP:-0}" = 1 ]; then echo "kept $work"; else rm -rf "$work"; fi; }
trap cleanup EXIT

# No network at all where we may make a network namespace (root, or unprivileged user namespaces): only a
# loopback, which the Jupyter kernel needs. Elsewhere pip alone is cut off from every index.
if unshare -n true 2>/dev/null; then
    offline=(unshare -n sh -c 'ip link set lo up 2>/dev/null || true; exec "$@"' sh)
    mode="no network at all (unshare -n: a network namespace with only a loopback)"
elif unshare -rn true 2>/dev/null; then
    offline=(unshare -rn sh -c 'ip link set lo up 2>/dev/null || true; exec "$@"' sh)
    mode="no network at all (unshare -rn)"
else
    offline=()
    mode="pip cut off from every index (PIP_NO_INDEX=1, PIP_CONFIG_FILE=/dev/null); the network itself was up"
fi
nopip=(env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null)

echo "== 1. gather (online) into $work/bundle"
t0=$SECONDS
"$PYTHON" scripts/offline_bundle.py gather "$work/bundle"
gather_s=$((SECONDS - t0))

echo "== 2. copy the bundle, as a machine in the room receives it"
cp -a "$work/bundle" "$work/room"

echo "== 3. install from the copy: $mode"
t0=$SECONDS
"${offline[@]}" "${nopip[@]}" "$PYTHON" "$work/room/workbook/scripts/offline_bundle.py" install "$work/room"
install_s=$((SECONDS - t0))

echo "== 4. use it offline"
cd "$work/room/workbook"
t0=$SECONDS
"${offline[@]}" "${nopip[@]}" .venv/bin/python -m pip check
"${offline[@]}" env HF_HUB_OFFLINE=1 .venv/bin/python - <<'EOF'
from pathlib import Path

import labkit
from labkit import LLM, SamplingParams

here = Path.cwd().resolve()
assert Path(labkit.__file__).resolve().is_relative_to(here), f"labkit imported from {labkit.__file__}, not {here}"
prompt = "Once upon a time"
out = LLM("labkit-tiny").generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs[0]
assert len(out.token_ids) == 16 and out.text.strip(), out
print(f"generated offline: {prompt}{out.text}")
EOF
# labkit.course.reset in a copy without git history: it restores from the .pristine/ copies the bundle ships
cp notebooks/03_kv_cache.ipynb "$work/original-03.ipynb"
echo '{"edited": true}' > notebooks/03_kv_cache.ipynb
"${offline[@]}" .venv/bin/python -m labkit.course.reset 03
cmp notebooks/03_kv_cache.ipynb "$work/original-03.ipynb" && echo "reset restored notebook 03 from .pristine/"
if [ "${NOTEBOOK:-1}" = 1 ]; then
    "${offline[@]}" env HF_HUB_OFFLINE=1 LABKIT_SMOKE=1 .venv/bin/python -m pytest -q notebooks/01_anatomy_of_a_request.ipynb
fi
check_s=$((SECONDS - t0))

echo "== summary"
echo "network during install and use: $mode"
for d in "$work/bundle" "$work/bundle/wheels" "$work/bundle/workbook" "$work/room/workbook/.venv"; do
    du -sh "$d" | sed 's/^/size  /'  # one at a time: du counts a folder inside another only once
done
echo "wheels: $(ls "$work/bundle/wheels" | wc -l)"
echo "time  gather ${gather_s} s, install ${install_s} s, offline checks ${check_s} s"
echo "offline round trip: OK"
