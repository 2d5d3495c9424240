"""What client processes import (the CLI, raygraph.LLM, the HTTP servers, benchmarks): connect
to the cluster, start or find the coordinator, check requests, subscribe to streams."""
