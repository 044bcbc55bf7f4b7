# Never finishes importing: run_autograder must still finish and grade every other file in full.
# target: reference
# where: prefix
while True:
    pass
