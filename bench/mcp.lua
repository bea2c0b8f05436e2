-- wrk script for bench/run.py: one MCP tools/call POST per request, rotating over a pool.
--
-- usage: wrk -t1 -c32 -d10s --latency -s bench/mcp.lua http://127.0.0.1:PORT/mcp -- POOL EXPECT [PAUSE]
--   POOL   a file of "<bearer token>\t<JSON body>" lines (written by bench/pool.py); a body
--          holding "@N@" gets the request's number there, so each request is a call of its own
--   EXPECT text every 2xx response body must contain ("-" checks nothing)
--   PAUSE  milliseconds each connection waits after an answer before its next request (default
--          0: closed loop, as fast as the server answers)
-- done() prints "BENCH issued=<n> unexpected=<n> pool=<n>" for run.py to parse.

local threads = {}

function setup(thread)
  table.insert(threads, thread)
  thread:set("thread_number", #threads)  -- keeps the numbers of two wrk threads apart
end

local function format_request(token, body)
  local headers = {
    ["Content-Type"] = "application/json",
    ["MCP-Protocol-Version"] = "2026-07-28",
    ["Mcp-Method"] = "tools/call",
    ["Mcp-Name"] = "connect_account",
    ["Authorization"] = "Bearer " .. token,
  }
  return wrk.format("POST", nil, headers, body)
end

function init(args)
  prepared = {}
  numbered = {}
  for line in io.lines(args[1]) do
    local token, body = line:match("^([^\t]+)\t(.+)$")
    if body:find("@N@", 1, true) then
      numbered[#prepared + 1] = {token, body}
    end
    prepared[#prepared + 1] = format_request(token, body)
  end
  -- a run of its own: the warm-up's numbers are not the measured run's
  run = string.format("%d%06d", os.time(), math.floor(os.clock() * 1e6) % 1000000)
  expected = args[2] ~= "-" and args[2] or nil
  pool = #prepared
  issued = 0
  unexpected = 0
  local pause = tonumber(args[3] or "0")
  if pause > 0 then
    -- wrk looks for a global delay() after init; defined only when asked, so the default run
    -- keeps wrk's plain closed loop
    delay = function() return pause end
  end
end

function request()
  issued = issued + 1
  local line = (issued - 1) % pool + 1
  local call = numbered[line]
  if call then
    local number = string.format("%s-%d-%d", run, thread_number, issued)
    return format_request(call[1], (call[2]:gsub("@N@", number, 1)))
  end
  return prepared[line]
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
