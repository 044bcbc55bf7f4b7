# A 20,000-term expression: the parser gives up on the file (RecursionError), in the import and in
# the grader's own line mapping. Only this file's tests may be lost, and results.json still lists
# every graded test with its points.
# file: layouts/compose_budget.py
# target: reference
# where: suffix
# generated: deep_expression
