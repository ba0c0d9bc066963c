"""nbgrader for llmcourse: instructor notebooks in solutions/, student notebooks in chapters/.

    nbgrader generate_assignment 01_tokenization --force     # one chapter
    python -m llmcourse release                               # every chapter (what CI checks)
"""

c = get_config()  # noqa: F821 (provided by nbgrader)

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
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
    "nbgrader.preprocessors.ClearHiddenTests",
    "llmcourse.grading.ShortTracebacks",
]

# A check that hangs must not stall autograding a whole class.
c.Execute.timeout = 300
