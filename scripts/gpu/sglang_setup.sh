#!/usr/bin/env bash
# On the device machine, after `bash scripts/gpu/stage.sh sgl/N` for every batch of .stage/sgl
# (scripts/gpu/sglang_wheels.sh; DEVELOPERS.md "SGLang on the H200"): check the staged files
# against MANIFEST.txt, install our runner's wheels and the GGUF (setup.sh: /tmp/site), SGLang and
# its dependencies into their OWN folder /tmp/sgl (the runner keeps the device's transformers 5.17
# and its pydantic 2.14; SGLang gets transformers 5.8.1 and pydantic 2.13), relax transformers
# 5.8.1's import-time pin tokenizers<=0.23.0 (the device has 0.23.2, which works), write the
# interpreter wrapper ~/sglang-python (stages.bench.sglang.python), put the MT-bench questions, HumanEval and
# the ShareGPT subset where the spec reads them, and check that SGLang imports. Source it; like
# setup.sh it does nothing twice and leaves the caller's shell options alone.
S=~/stage
if [ -f $S/MANIFEST.txt ]; then
  (cd $S && awk '$1 != "-" {print $4 "  " $2}' MANIFEST.txt | sha256sum -c --quiet -) \
    || echo "sglang_setup.sh: staged files differ from MANIFEST.txt (a batch missing?): stage it again" >&2
else
  echo "sglang_setup.sh: no ~/stage/MANIFEST.txt: the last batch of .stage/sgl is not staged" >&2
fi
source scripts/gpu/setup.sh
WH=$(ls $S/sgl/*.whl 2>/dev/null | sort | md5sum | cut -c1-32)
if [ "$(cat /tmp/sgl/.wheels 2>/dev/null)" != "$WH" ]; then
  T0=$SECONDS
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/sgl $S/sgl/*.whl \
  && sed -i 's/"tokenizers>=0.22.0,<=0.23.0"/"tokenizers>=0.22.0"/' \
       /tmp/sgl/transformers/dependency_versions_table.py \
  && echo "$WH" > /tmp/sgl/.wheels && echo "sglang_setup.sh: /tmp/sgl installed in $((SECONDS - T0)) s"
fi
# sglang/utils.py imports IPython.display's HTML and display at import time, for notebooks only
# (the H200 image has no IPython: "No module named 'IPython'" stopped every server on
# 2026-12-04); a two-name stand-in instead of IPython and its nine dependencies
if [ ! -f /tmp/sgl/IPython/display.py ]; then
  mkdir -p /tmp/sgl/IPython && : > /tmp/sgl/IPython/__init__.py
  printf '"""Stand-in for sglang/utils.py (scripts/gpu/sglang_setup.sh)."""\n\n\nclass HTML(str):\n    pass\n\n\ndef display(*objs, **kw):\n    pass\n' > /tmp/sgl/IPython/display.py
fi
cat > ~/sglang-python <<'WRAP'
#!/usr/bin/env bash
# SGLang's interpreter on this machine: the image's python3 (torch 2.11, triton) with /tmp/sgl
# FIRST on PYTHONPATH (scripts/gpu/sglang_setup.sh), so SGLang's transformers 5.8.1 and pydantic
# 2.13 win over the runner's; the caller's path follows (a capture server needs the folder
# holding eagle3_runner that targets/sglang_target.py capture_env puts there).
export PYTHONPATH=/tmp/sgl${PYTHONPATH:+:$PYTHONPATH}
exec python3 "$@"
WRAP
chmod +x ~/sglang-python
mkdir -p "$EAGLE3_CACHE/mtbench" "$EAGLE3_CACHE/sharegpt" "$EAGLE3_CACHE/humaneval"
cp -f $S/question.jsonl "$EAGLE3_CACHE/mtbench/" 2>/dev/null
# the extract stage's contamination guard reads HumanEval too (without it extract stopped at once
# on 2026-12-05: "HumanEval ... not found")
cp -f $S/HumanEval.jsonl.gz "$EAGLE3_CACHE/humaneval/" 2>/dev/null
cp -f $S/sharegpt-*.jsonl.gz "$EAGLE3_CACHE/sharegpt/" 2>/dev/null
~/sglang-python -c "import sglang, transformers, sgl_kernel, flashinfer.sampling; print('sglang', \
sglang.__version__, 'transformers', transformers.__version__)" 2>&1 | grep -v "Ignore import" | tail -3
