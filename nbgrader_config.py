"""nbgrader for llmcourse: instructor notebooks in solutions/, student notebooks in chapters/.

The course directory is the repository root (this file's folder); instructor.md shows the commands.

    python -m llmcourse release      # every chapter: nbgrader generate_assignment, recorded in gradebook.db
"""

import warnings

c = get_config()  # noqa: F821 (provided by nbgrader)

# nbgrader's Gradebook.add_submission builds a student's submission, reads the chapter's notebooks
# (a lazy load, which flushes the session), then adds the submission to the session. SQLAlchemy 2
# warns, three times per student, that the flush could not yet add the half-built objects; the very
# next statement adds them with all their grade rows (tests/test_instructor_guide.py reads the grades
# back), so the warning is noise.
warnings.filterwarnings("ignore", message=r"Object of type <Submitted\w+> not in session, add operation along")

c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "chapters"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"

# Book-only prose (the link from a book page to its exercise notebook) lives in plain markdown cells
# between <!-- BEGIN SOLUTION --> / <!-- END SOLUTION -->; the release shows this note in its place.
c.ClearSolutions.enforce_metadata = False
c.ClearSolutions.text_stub = (
    "**This is the exercise notebook.** Write your code where it says `# YOUR CODE HERE` and run the "
    "check cell below each exercise; `python -m llmcourse progress` shows your progress."
)
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}

# Learners never see the hidden tests, not even in their feedback: neither in the check cells nor in
# the source lines a traceback would quote.
# (llmcourse.course.grading.ClearHiddenTests is nbgrader's, minus a spurious config warning.)
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
    "llmcourse.course.grading.ClearHiddenTests",
    "llmcourse.course.grading.ShortTracebacks",
]

# nbgrader's autograde sanitizing steps, with OverwriteCells quiet about the hidden tests that the
# release removed and autograde puts back (it warned once per check cell and student).
c.Autograde.sanitize_preprocessors = [
    "nbgrader.preprocessors.ClearOutput",
    "nbgrader.preprocessors.DeduplicateIds",
    "nbgrader.preprocessors.OverwriteKernelspec",
    "llmcourse.course.grading.OverwriteCells",
    "nbgrader.preprocessors.CheckCellMetadata",
]

# nbgrader's steps for the release, and last, each check cell tagged `raises-exception`: Run All in JupyterLab goes
# on past a check that fails (an exercise not written yet) to the demonstrations after it.
c.GenerateAssignment.preprocessors = [
    "nbgrader.preprocessors.IncludeHeaderFooter",
    "nbgrader.preprocessors.InstantiateTests",
    "nbgrader.preprocessors.LockCells",
    "nbgrader.preprocessors.ClearSolutions",
    "nbgrader.preprocessors.ClearOutput",
    "nbgrader.preprocessors.CheckCellMetadata",
    "nbgrader.preprocessors.ComputeChecksums",
    "nbgrader.preprocessors.SaveCells",
    "nbgrader.preprocessors.ClearHiddenTests",
    "nbgrader.preprocessors.ClearMarkScheme",
    "nbgrader.preprocessors.ComputeChecksums",
    "nbgrader.preprocessors.CheckCellMetadata",
    "llmcourse.course.grading.RunAllGoesOn",
]

# A cell that hangs must not stall autograding a whole class; but this limit is on the wall, and a grading machine
# that is busy gives a cell a fraction of a core. The checks inside limit the learner's CPU time themselves (and stop
# an endless loop or a long sleep within a minute or so), so this is only a last resort, far above the longest
# solution cell (chapter 12's, about 70 CPU-s with every chapter's checks) even at a quarter of a core.
c.Execute.timeout = 1200
