# The live specd server (real model, fp32) of the server tests, for the load generator's tests.
from tests.server.conftest import built, live  # noqa: F401
