# One image for every conveyor role; the command picks it:
#   API     python -m api.serve   (HTTP 8000, gRPC 8001; needs CONVEYOR_API_KEYS_FILE)
#   worker  celery -A workers.app worker --loglevel INFO
#   Flower  celery -A workers.app flower --port=5555
#
# CPU build of torch by default. For GPU workers, build with the CUDA index that
# matches your driver, e.g.:
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t conveyor:gpu .
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# torch first, from its own index: the largest layer, and it changes least often.
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX}

# Only what the package needs, so a local .venv or test output never enters the image.
COPY pyproject.toml ./
COPY api ./api
COPY batching ./batching
COPY workers ./workers
COPY conveyor ./conveyor
RUN pip install .

# The bundled model repository. A volume mounted on /app/models replaces it (an empty
# named volume is first filled from here).
COPY models ./models

RUN useradd --create-home --uid 1000 conveyor && chown -R conveyor /app
USER conveyor

# Every interface of the container: the API then refuses to start without API keys
# (CONVEYOR_API_KEYS_FILE, mounted from a secret) unless CONVEYOR_ALLOW_UNAUTHENTICATED=1.
ENV CONVEYOR_MODEL_REPOSITORY=/app/models \
    CONVEYOR_HOST=0.0.0.0
EXPOSE 8000 8001 8002 5555
CMD ["python", "-m", "api.serve"]
