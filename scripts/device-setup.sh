# Sourced on the lent GPU machine, in the repository root, before a bench or GPU test:
#   source scripts/device-setup.sh && python3 "$R/bench/device_runs.py" GROUP
# Its image has torch, transformers, accelerate and peft but not TRL, datasets, sqlmodel, pydantic or gguf, and
# nothing it runs may reach a network, so what it lacks is carried from here (a call carries at most 64 MiB):
#   bash scripts/device-wheels.sh && pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf
#   mkdir -p .mortal && cp -r "$MORTAL_TEST_ASSETS" .mortal/assets   # the tests' assets: SmolLM2's tokenizer, configs
#   bash scripts/device-gguf.sh                             # the 94 MB GGUF in three parts: .mortal/p1, p2, p3
# A call carries .whl with .mortal/assets (or .mortal/p1), and later calls on the same warm machine the other
# parts: an ignored folder a call does not name stays on a warm machine, and an idle one is soon given back.
# It installs the wheels once and this tree every time into /tmp/site, joins the GGUF's parts into
# ~/smol.gguf once all have arrived, and leaves the shell in /tmp: the repository root's mortal/
# folder would shadow the installed package. $R is the repository root.
# State on the machine (~/...) is lost when it is given back: a run that needs two calls (TRL's 200
# steps of the learning bench) may have to start over.
R=$(pwd)
if [ ! -f /tmp/site/.wheels ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $(ls "$R"/.whl/*.whl | grep -v /mortal-) && touch /tmp/site/.wheels
fi
rm -rf /tmp/site/mortal /tmp/site/mortal-*.dist-info
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site "$R" 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site MORTAL_TEST_ASSETS=$R/.mortal/assets PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The GGUF's parts: each call brings some (kept in ~/gguf-parts); joined once their whole has the md5 of
# .mortal/p1/smol.gguf.md5 (written with the split), so a missing or partial part is never read as a model.
mkdir -p "$HOME"/gguf-parts
cp -n "$R"/.mortal/p[123]/smol.gguf.part* "$R"/.mortal/p1/smol.gguf.md5 "$HOME"/gguf-parts/ 2>/dev/null
if [ ! -f "$HOME"/smol.gguf ] && [ -f "$HOME"/gguf-parts/smol.gguf.md5 ]; then
  cat "$HOME"/gguf-parts/smol.gguf.part* > "$HOME"/smol.gguf.joining
  if [ "$(md5sum < "$HOME"/smol.gguf.joining | cut -d' ' -f1)" = "$(cat "$HOME"/gguf-parts/smol.gguf.md5)" ]; then
    mv "$HOME"/smol.gguf.joining "$HOME"/smol.gguf && echo "joined $HOME/smol.gguf"
  else
    rm -f "$HOME"/smol.gguf.joining && echo "GGUF parts so far: $(ls "$HOME"/gguf-parts | tr '\n' ' ')"
  fi
fi
cd /tmp || return
