-- wrk -s benchmarks/gateway/post.lua: small non-streamed chat completions with an API key.
wrk.method = "POST"
wrk.body = '{"model":"stub","messages":[{"role":"user","content":"Say hello"}],"max_tokens":8}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench"
