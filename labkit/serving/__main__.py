"""``python -m labkit.serving``: labkit's OpenAI-compatible server (see ``labkit.serving.cli``).

    python -m labkit.serving --model labkit-tiny --engine chunked --port 8000

Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from labkit.serving.cli import main

if __name__ == "__main__":
    main()
