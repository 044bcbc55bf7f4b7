"""compose.py's layouts (pp x cp x dp): which one fits and what each rank holds and each link
carries (compose_budget), and a checkpoint saved at one layout and resumed at any other
(compose_checkpoint)."""
