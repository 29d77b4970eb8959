"""The planning passes, one module each; ``plan/pipeline.py`` lists them in the order they run."""
