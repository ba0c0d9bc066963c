"""What every chapter's checks are built on: cases and verdicts (`core`), running the learner's code
in a child process (`isolate`) under a watch for forbidden functions (`forbid`), tensor comparisons,
inputs, limits, randomness contracts and how results are shown."""
