-- floodgate: decides one request against all limits of its route.
--
-- KEYS[i]  the key of limit i; all share one hash tag (route and client),
--          so Redis Cluster keeps them in one slot
-- ARGV[1]  now in milliseconds, or "" to take it from Redis TIME (always ""
--          in production, so every instance shares Redis's clock; tests
--          pass it to be deterministic)
-- ARGV[2]  cost: units the request consumes
-- then for each limit i, four arguments: algorithm name, limit, window (ms),
--          burst
--
-- Reply: four integers per limit, in order: allowed (1/0), remaining,
-- reset_ms, retry_after_ms. Either every limit allowed and consumed the
-- cost, or none consumed anything.
local algorithms = {
  fixed_window = fixed_window,
  sliding_log = sliding_log,
  sliding_window = sliding_window,
  token_bucket = token_bucket,
  gcra = gcra,
}

local now = tonumber(ARGV[1])
if not now then
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end
local cost = tonumber(ARGV[2])

local reply, states, allowed = {}, {}, true
for i = 1, #KEYS do
  local at = 2 + (i - 1) * 4
  local algorithm = algorithms[ARGV[at + 1]]
  if not algorithm then
    return redis.error_reply('floodgate: unknown algorithm ' .. tostring(ARGV[at + 1]))
  end
  local verdict, state = algorithm.check(KEYS[i], tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3]),
    now, cost, tonumber(ARGV[at + 4]))
  states[i] = state
  for j = 1, 4 do
    reply[#reply + 1] = verdict[j]
  end
  if verdict[1] == 0 then
    allowed = false
  end
end

if allowed then
  for i = 1, #KEYS do
    local at = 2 + (i - 1) * 4
    algorithms[ARGV[at + 1]].commit(KEYS[i], tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3]),
      now, cost, states[i], tonumber(ARGV[at + 4]))
  end
end
return reply
