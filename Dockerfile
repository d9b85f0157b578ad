# PLACEHOLDER -- not a working image yet. The observability/deployment issue builds the real one
# (CUDA runtime base, CUDA torch, non-root user, model cache volume, healthcheck on /ready).
# No Docker engine runs on the development machines, so nothing here has been built or run.
FROM python:3.11-slim
RUN echo "specd image not built yet: see the observability/deployment issue" && exit 1
