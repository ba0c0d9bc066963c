"""The course around the engine: a learner's functions in it (`learner`, `guards`), running saved
chapters (`progress`), nbgrader (`grading`), stored notebook outputs (`refresh`), interactive figures,
and reference code the engine never calls (byte-level BPE in plain Python)."""
