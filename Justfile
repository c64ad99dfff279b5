# just demo | just test | just plan-kimi
demo:
    bash scripts/demo.sh

test:
    bash scripts/test.sh

plan-kimi:
    runner plan specs/drafter-v2.yaml

fetch:
    runner fetch all
