# Sourced on the lent GPU machine, in the repository root (`source scripts/device-setup.sh`), before a
# bench or GPU test. Its image has torch, transformers, accelerate and peft but not TRL, datasets,
# sqlmodel, pydantic or gguf, and nothing it runs may reach a network, so what it lacks is carried:
#   here:  bash scripts/device-wheels.sh && pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf
#          mkdir -p .mortal && cp -r ../shared/anchors/assets .mortal/assets
#          bash scripts/device-gguf.sh   # the 94 MB GGUF in parts: .mortal/p1, p2, p3 (gitignored)
#   call 1 carries [".whl", ".mortal/p1"], call 2 [".mortal/p2"], call 3 [".mortal/p3", ".mortal/assets"], back
#   to back (each near the 64 MiB a call carries with the tree's 4.4 MiB; .whl, p1 and assets together were
#   refused, 2026-11-28): an ignored folder a call does not name stays on a warm machine, and a machine idle
#   for 30 s is given back. Calls 1 and 2 can run groups that need no GGUF and no assets (regional). A group
#   that needs the assets (every bench/gpu_step.py group: SmolLM2's tokenizer) but no GGUF goes first with
#   [".whl", ".mortal/assets"], then p1, p2 and p3 in three calls of their own.
# It installs the wheels once and this tree every time into /tmp/site, joins the GGUF parts into
# /root/smol.gguf once all have arrived, and leaves the shell in /tmp: the repository root's mortal/
# folder would shadow the installed package. $R is the repository root.
# State on the machine (/root/...) is lost when it is given back, which has happened between two calls
# a few seconds apart: a run that needs two calls (TRL's 200 steps) may have to start over.
R=$(pwd)
if [ ! -f /tmp/site/.wheels ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $(ls "$R"/.whl/*.whl | grep -v /mortal-) && touch /tmp/site/.wheels
fi
rm -rf /tmp/site/mortal /tmp/site/mortal-*.dist-info
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site "$R" 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site MORTAL_TEST_ASSETS=$R/.mortal/assets PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The GGUF's parts: each call brings some (kept in /root/gguf-parts); joined once their whole has the md5 of
# .mortal/p1/smol.gguf.md5 (written with the split), so a missing or partial part is never read as a model.
mkdir -p /root/gguf-parts
cp -n "$R"/.mortal/p[123]/smol.gguf.part* "$R"/.mortal/p1/smol.gguf.md5 /root/gguf-parts/ 2>/dev/null
if [ ! -f /root/smol.gguf ] && [ -f /root/gguf-parts/smol.gguf.md5 ]; then
  cat /root/gguf-parts/smol.gguf.part* > /root/smol.gguf.joining
  if [ "$(md5sum < /root/smol.gguf.joining | cut -d' ' -f1)" = "$(cat /root/gguf-parts/smol.gguf.md5)" ]; then
    mv /root/smol.gguf.joining /root/smol.gguf && echo "joined /root/smol.gguf"
  else
    rm -f /root/smol.gguf.joining && echo "GGUF parts so far: $(ls /root/gguf-parts | tr '\n' ' ')"
  fi
fi
cd /tmp || return
