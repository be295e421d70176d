-- floodgate: shared helpers for the decision script.
--
-- The files in lua/ are joined into one script, in this order: prelude.lua,
-- one file per algorithm (each followed by `loaders.<name> = <name>`),
-- decide.lua. Redis runs the whole script on every
-- call, so it is written to do little besides its redis.call()s: each
-- algorithm file defines one loader function, and only the loaders of the
-- algorithms a request uses run. A loader returns two functions:
--
--   check(key, limit, window, now, cost, burst, delay)
--     -> allowed (1/0, or 2: admitted held, retry_after_ms its wait; gcra
--     with a `delay` in ms alone), remaining, next_ms, retry_after_ms, a, b, c
--     next_ms is the wait until at least one more unit is made available,
--     whether or not units remain and whatever this request's cost
--     (RateLimit's `t` per draft-ietf-httpapi-ratelimit-headers-10): a
--     fixed window's end, the oldest logged unit leaving, the weighted
--     count falling by a unit, the next token added (0 while a bucket is
--     full); retry_after_ms is this request's own wait when denied.
--     Whether `cost` units fit in the limit stored at `key` at time `now`
--     (milliseconds). It may tidy the key (drop expired entries) but never
--     consumes. `a`, `b` and `c` are what it read, handed back to commit so
--     that commit need not read again.
--   commit(key, limit, window, now, cost, burst, a, b, c)
--     Takes the units, and sets the key's TTL in the same call.
--
-- Time never runs backwards inside a key. Redis `TIME` can step back (an
-- NTP step, a failover to a replica whose clock is behind); each algorithm
-- decides at the later of `now` and the latest time its key has seen, so a
-- step back never reopens a window that was already counted:
--   fixed_window, sliding_window: the key's window start (decisions in a
--     window do not depend on where in it `now` falls beyond that, except
--     the sliding weight, which an earlier time only makes stricter);
--   token_bucket: the time its tokens were counted at;
--   sliding_log: its newest entry (an earlier `now` only expires less);
--   gcra: its theoretical arrival time (an earlier `now` only leaves the
--     TAT further ahead, which is stricter).
--
-- decide.lua calls every limit's check, then every commit only if all
-- allowed, so a route's limits decide all or nothing in one round trip; one
-- call may decide several requests this way, one after another.
-- The pure Rust twins in src/limit/algorithms/ (one module per script)
-- follow the same steps.
--
-- State: every algorithm but the sliding log keeps one string of two or
-- three whole numbers separated by spaces ("1700000000000 3"), read through
-- load() and written through save(), at most once each per call, with
-- SET … PX so value and TTL change in one command.

-- Every algorithm's loader, by its name in configuration files: floodgate
-- puts each algorithm file's line here after it (see src/limit/redis/code.rs).
local loaders = {}

-- The library functions the code uses, as locals: reaching a local costs
-- Redis less than looking up a global on every use. A function library may
-- not touch the globals while Redis loads it, so decide() binds these on
-- its first call (the plain script, which runs whole on every call, binds
-- them on every call).
local floor, max, format, match, gmatch, tonumber, type, redis_call, redis_pcall
local min, pack, unpack, concat
local function bind()
  floor, max = math.floor, math.max
  format, match, gmatch = string.format, string.match, string.gmatch
  min, concat = math.min, table.concat
  pack, unpack = struct.pack, _G.unpack
  -- _G: the bare names would be these very locals, still unbound.
  tonumber, type = _G.tonumber, _G.type
  redis_call, redis_pcall = redis.call, redis.pcall
end

-- The window time `t` falls in: its start and length. `window` is a
-- length (windows aligned to its multiples), or, for a fixed window by the
-- calendar, four boundaries {b0, b1, b2, b3} that floodgate computed around
-- its own clock (the previous window's start, the current one's, the
-- next's and the one after); Redis TIME picks among them, so instances
-- whose clocks disagree at a boundary count in the same window. Past the
-- last boundary windows go on with the last one's length, before the
-- first with the first one's. The twin is Limit::span in src/limit/mod.rs.
local function span(t, window)
  if type(window) == 'number' then
    return t - (t % window), window
  end
  local b = window
  if t >= b[4] then
    local len = max(b[4] - b[3], 1)
    return t - ((t - b[4]) % len), len
  end
  for i = 3, 1, -1 do
    if t >= b[i] then
      return b[i], b[i + 1] - b[i]
    end
  end
  local len = max(b[2] - b[1], 1)
  local back = floor((b[1] - t + len - 1) / len) * len
  return max(b[1] - back, 0), len
end

-- Whole numbers as Redis arguments, never in exponent notation.
local function int(n)
  return format('%d', n)
end

-- Keys outlive the moment their state stops mattering by this much. A late
-- expiry changes no decision (every algorithm reads a stale key as the empty
-- one it stands for), while an early one would: Redis expires keys by its
-- own clock, which can differ from the decision's `now` (a promoted replica,
-- or a test passing `now`).
local EXPIRY_SLACK_MS = 1000

-- Keys that several requests of one call use (a busy client's requests that
-- arrived together) are read once and written once per call: `held` keeps
-- their numbers, {a, b, c, ms}, where ms is set once a decision has changed
-- them, and `written` lists those keys in order for write_back() at the
-- call's end. Each decision still sees every earlier one, exactly as if each
-- had been its own call, since nothing else runs between them. A key that
-- only one request uses is read and written directly, as that is cheaper
-- than keeping it.
local shared, held, written

-- Starts a call whose keys are KEYS: finds the ones used more than once.
local function begin(KEYS)
  shared, held, written = nil, nil, nil
  local n = #KEYS
  if n < 2 then
    return
  end
  local seen = {}
  for i = 1, n do
    local key = KEYS[i]
    if not seen[key] then
      seen[key] = true
    elseif not shared then
      shared, held, written = {[key] = true}, {}, {}
    else
      shared[key] = true
    end
  end
end

-- The numbers in a stored value, or nothing for a missing key. A key that
-- holds something else (another type, or text that is not our numbers)
-- reads as missing, and the commit that follows overwrites it.
local function parse(value)
  if type(value) ~= 'string' then
    return nil
  end
  local a, b, c = match(value, '^(-?%d+) (-?%d+) ?(-?%d*)$')
  if a then
    return tonumber(a), tonumber(b), tonumber(c)
  end
  -- A fixed window by the calendar, with its end.
  local d
  a, b, c, d = match(value, '^(-?%d+) (-?%d+) (-?%d+) (-?%d+)$')
  return tonumber(a), tonumber(b), tonumber(c), tonumber(d)
end

-- The numbers at `key`, or nothing when it is missing.
local function load(key)
  if not (shared and shared[key]) then
    return parse(redis_pcall('GET', key))
  end
  local state = held[key]
  if not state then
    state = {parse(redis_pcall('GET', key))}
    held[key] = state
  end
  return state[1], state[2], state[3], state[4]
end

-- Writes two, three or four whole numbers at `key`, expiring `ms` from
-- now plus the slack.
local function store(key, ms, a, b, c, d)
  local value
  if d then
    value = format('%d %d %d %d', a, b, c or 0, d)
  elseif c then
    value = format('%d %d %d', a, b, c)
  else
    value = format('%d %d', a, b)
  end
  redis_call('SET', key, value, 'PX', int(max(ms, 0) + EXPIRY_SLACK_MS))
end

-- Stores two, three or four whole numbers at `key`: now, or at the
-- call's end if other requests of the call use the key too.
local function save(key, ms, a, b, c, d)
  if not (shared and shared[key]) then
    return store(key, ms, a, b, c, d)
  end
  local state = held[key]
  if not state then
    state = {}
    held[key] = state
  end
  if not state[6] then
    written[#written + 1] = key
  end
  state[1], state[2], state[3], state[4], state[5], state[6] = a, b, c, d, nil, ms
end

-- Writes the shared keys the call changed, each once.
local function write_back()
  if not written then
    return
  end
  for i = 1, #written do
    local key = written[i]
    local state = held[key]
    store(key, state[6], state[1], state[2], state[3], state[4])
  end
end

-- floor(a / b) for non-negative integers, exact even where the division of
-- two doubles would round up to the next whole number.
local function floor_div(a, b)
  local q = floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

-- ceil(a / b) for non-negative integers.
local function ceil_div(a, b)
  return floor_div(a + b - 1, b)
end
