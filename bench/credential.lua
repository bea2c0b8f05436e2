-- wrk script for bench/run.py: one GET per request with its own path and bearer, over a pool.
--
-- usage: wrk -t1 -c32 -d10s --latency -s bench/credential.lua http://127.0.0.1:PORT -- POOL EXPECT
--   POOL   a file of "<bearer secret>\t<path and query>" lines (written by bench/pool.py)
--   EXPECT text every 2xx response body must contain ("-" checks nothing)
-- done() prints "BENCH issued=<n> unexpected=<n> pool=<n>" for run.py to parse (as bench/mcp.lua).

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  prepared = {}
  for line in io.lines(args[1]) do
    local token, path = line:match("^([^\t]+)\t(.+)$")
    prepared[#prepared + 1] = wrk.format("GET", path, { ["Authorization"] = "Bearer " .. token })
  end
  expected = args[2] ~= "-" and args[2] or nil
  pool = #prepared
  issued = 0
  unexpected = 0
end

function request()
  issued = issued + 1
  return prepared[(issued - 1) % pool + 1]
end

function response(status, headers, body)
  if expected and status < 300 and not body:find(expected, 1, true) then
    unexpected = unexpected + 1
  end
end

function done(summary, latency, requests)
  for _, thread in ipairs(threads) do
    io.write(string.format("BENCH issued=%d unexpected=%d pool=%d\n",
      thread:get("issued"), thread:get("unexpected"), thread:get("pool")))
  end
end
