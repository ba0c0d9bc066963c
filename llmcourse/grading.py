"""nbgrader additions for the course.

`ShortTracebacks` runs when feedback is generated: a failed check's traceback would print the
check cell's source around the failing line — hidden tests included — so each error output is cut
down to its last line, `CheckFailed: <the check's message>`, which is what a learner needs.
"""

from nbconvert.preprocessors import Preprocessor


class ShortTracebacks(Preprocessor):
    enabled = True  # nbconvert skips preprocessors that are not enabled

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code":
            for output in cell.get("outputs", []):
                if output.get("output_type") == "error":
                    output["traceback"] = [f"{output.get('ename', 'Error')}: {output.get('evalue', '')}"]
        return cell, resources
