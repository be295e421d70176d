-- floodgate: decide(KEYS, ARGV) decides one or more requests, each against
-- all limits of its route, one after another. script.lua or library.lua,
-- joined after this file, call it.
--
-- KEYS     the keys of every request's limits, request after request. A
--          request's keys share one hash tag (route and client), so Redis
--          Cluster keeps them in one slot; floodgate sends requests of
--          several clients in one call only to a Redis that is not a
--          cluster.
-- ARGV     three per request, in the same order:
--            now in milliseconds, or "" to take it from Redis TIME (always
--              "" in production, so every instance shares Redis's clock;
--              tests pass it to be deterministic)
--            cost: units the request consumes; or, to settle a
--              reservation, "<used> <at> <reserved>": `reserved` units
--              were taken by a decision at time `at` and the answer
--              reported `used` (see each algorithm's settle); or, to
--              give back the part of a refused request taken before
--              another part (in another cluster slot) refused it,
--              "r <at> <reserved>": every limit gets back what it took,
--              `reserved` or 1 for a limit counting requests; or, for an
--              operator's grant, "g <units>" (grant_one)
--            the route's limits, "<algorithm> <limit> <window ms> <burst>
--              <per request>" for each, separated by spaces; one key per
--              limit. A fixed window by the calendar has its four
--              boundaries "<b0>,<b1>,<b2>,<b3>" (ms) in place of
--              <window ms>: see span() in prelude.lua. <per request> is 1 for a limit that counts each
--              request as one unit whatever its cost (a settlement leaves
--              it as decided), else 0; a limit with a penalty has
--              "p<duration>,<factor per mille>,<max>,<forget>" (ms) right
--              after it: see penalized and offend; a limit with a delay
--              has "d<delay ms>" last (gcra)
--
-- Reply: per request, in order, four integers per limit (allowed (1/0,
-- or 2: admitted and held, the fourth its wait), remaining, next_ms,
-- retry_after_ms; for a settlement or a grant, always
-- allowed, the fourth is the units granted in force: see held), then the time it was decided at
-- (ms; what a settlement names as `at`), packed as signed
-- 64-bit little-endian integers in one string (struct.pack '<i8…'). A
-- client reads one string instead of an array of integers, each its own
-- RESP element: for floodgate, that is most of the cost of reading a
-- reply, while packing costs Redis no more than sending the array. For
-- each request,
-- either every limit allowed and consumed the cost, or none consumed
-- anything. A request sees what the requests before it in the same call
-- consumed, exactly as if each had been its own call.
-- The function library (library.lua) loads every algorithm once, when
-- Redis loads the library, and sets this; the plain script (script.lua)
-- leaves it unset and loads the algorithms a call uses, on every call.
local loaded = nil

-- The check and commit functions of algorithm `name`, or nothing.
local function algorithm(name)
  if loaded then
    local pair = loaded[name]
    if pair then
      return pair[1], pair[2], pair[3], pair[4]
    end
    return nil
  end
  local load = loaders[name]
  if load then
    return load()
  end
  return nil
end

-- Routes' limits, parsed: the text of ARGV's third argument -> a list of
-- {check, commit, limit, window, burst, settle, per_request, grant,
-- penalty, delay}. The same text comes with every
-- request of a route, so a function library parses it once, not per call.
-- The texts come from floodgate's configuration, so they are few; the
-- table starts over if it ever holds many.
local parsed, parsed_count = {}, 0

-- The limits in `text`, or nothing and the name of an unknown algorithm.
local function limits_of(text)
  local limits = parsed[text]
  if limits then
    return limits
  end
  limits = {}
  for name, limit, window, burst, per_request, penalty, delay in gmatch(text, '(%S+) (%d+) ([%d,]+) (%d+) ([01])p?([%d,]*)d?(%d*)') do
    local check, commit, settle, grant = algorithm(name)
    if not check then
      return nil, name
    end
    -- A window by the calendar: its four boundaries (see span).
    local w = tonumber(window)
    if not w then
      w = {}
      for b in gmatch(window, '%d+') do
        w[#w + 1] = tonumber(b)
      end
      if #w ~= 4 then
        return nil, name .. ' with a window of ' .. window
      end
    end
    local p = nil
    if penalty ~= '' then
      p = {}
      for n in gmatch(penalty, '%d+') do
        p[#p + 1] = tonumber(n)
      end
      if #p ~= 4 then
        return nil, name .. ' with a penalty of ' .. penalty
      end
    end
    limits[#limits + 1] = {check, commit, tonumber(limit), w, tonumber(burst), settle, per_request == '1', grant, p, tonumber(delay) or 0}
  end
  if parsed_count >= 1000 then
    parsed, parsed_count = {}, 0
  end
  parsed[text], parsed_count = limits, parsed_count + 1
  return limits
end

-- Penalties (src/limit/penalty.rs): under a count's key and ':p', in the
-- same slot, "<until> <offences> <remembered until>", kept while the
-- offences are remembered (each time told from the call's `now`, as the
-- counts are, not from the key's expiry). The wait until the penalty under count key `k` ends, or
-- nothing when none runs at `now`.
local function penalized(k, now)
  local v = redis_call('GET', k .. ':p')
  if not v then
    return nil
  end
  local ends = tonumber(match(v, '^(%d+)'))
  if ends and ends > now then
    return ends - now
  end
  return nil
end

-- An offence at `now` against the limit counted at `k` with penalty `p`
-- ({duration, factor per mille, max, forget}): the `n`th in a row serves
-- duration × factor^(n−1), at most max; the offences are remembered
-- forget after this one (or to the penalty's end). Returns what it serves.
local function offend(k, p, now)
  local pk = k .. ':p'
  local v = redis_call('GET', pk)
  local offences = 1
  if v then
    local _, n, remembered = match(v, '^(%d+) (%d+) (%d+)$')
    if n and tonumber(remembered) > now then
      offences = tonumber(n) + 1
    end
  end
  local d = min(p[1], p[3])
  for _ = 2, offences do
    d = min(floor(d * p[2] / 1000), p[3])
    if d == p[3] then
      break
    end
  end
  local kept = max(d, p[4])
  redis_call('SET', pk, int(now + d) .. ' ' .. int(offences) .. ' ' .. int(now + kept), 'PX', int(kept))
  return d
end

-- Decides one request against `limits`, whose keys start at KEYS[key],
-- writing its verdicts into `reply` from reply[out]. A limit whose
-- penalty runs refuses to its end before its count is read; a limit with
-- a penalty that refuses on its own count starts one.
local function decide_one(KEYS, key, limits, now, cost, reply, out)
  local n = #limits
  -- One limit without a penalty, the common case: no bookkeeping across
  -- limits.
  if n == 1 and not limits[1][9] then
    local l, k = limits[1], KEYS[key]
    local limit, window, burst = l[3], l[4], l[5]
    local units = cost
    if l[7] then
      units = 1
    end
    local ok, remaining, reset, retry, a, b, c = l[1](k, limit, window, now, units, burst, l[10])
    if ok ~= 0 then
      l[2](k, limit, window, now, units, burst, a, b, c)
    end
    reply[out], reply[out + 1], reply[out + 2], reply[out + 3] = ok, remaining, reset, retry
    return
  end

  local read_a, read_b, read_c, allowed = {}, {}, {}, true
  local serving = nil
  for i = 1, n do
    local l, o = limits[i], out + (i - 1) * 4
    local units = cost
    if l[7] then
      units = 1
    end
    local wait = l[9] and penalized(KEYS[key + i - 1], now)
    if wait then
      serving = serving or {}
      serving[i] = true
      reply[o], reply[o + 1], reply[o + 2], reply[o + 3] = 0, 0, wait, wait
      allowed = false
    else
      local ok, remaining, reset, retry, a, b, c = l[1](KEYS[key + i - 1], l[3], l[4], now, units, l[5], l[10])
      read_a[i], read_b[i], read_c[i] = a, b, c
      reply[o], reply[o + 1], reply[o + 2], reply[o + 3] = ok, remaining, reset, retry
      if ok == 0 then
        allowed = false
      end
    end
  end

  if allowed then
    for i = 1, n do
      local l = limits[i]
      local units = cost
      if l[7] then
        units = 1
      end
      l[2](KEYS[key + i - 1], l[3], l[4], now, units, l[5], read_a[i], read_b[i], read_c[i])
    end
    return
  end
  -- Refused: nothing was taken, so a limit that would have allowed reports
  -- what it holds (as a settlement does), not what it would have held; a
  -- limit with a penalty that refused on its own count starts one.
  for i = 1, n do
    local l, o = limits[i], out + (i - 1) * 4
    if reply[o] == 0 and l[9] and not (serving and serving[i]) then
      local serves = offend(KEYS[key + i - 1], l[9], now)
      reply[o + 1], reply[o + 2], reply[o + 3] = 0, serves, serves
    elseif reply[o] ~= 0 then
      local _, remaining, reset = l[1](KEYS[key + i - 1], l[3], l[4], now, 0, l[5])
      reply[o], reply[o + 1], reply[o + 2], reply[o + 3] = 1, max(remaining, 0), reset, 0
    end
  end
end

-- Tells every floodgate instance sharing this store that units were given
-- back under key `k`'s hash tag (`prefix:{route:client}`): a message with
-- the tag on the channel `prefix:given-back`, so that an instance holding
-- a remembered denial for that tag asks the store again. Each tag once per
-- settlement (`told` holds those sent). PUBLISH by pcall: a Redis user
-- without permission on the channel still settles (its instances cannot
-- subscribe either, and then remember no denial).
local function given_back(k, told)
  local tag = match(k, '^(.*})')
  if not tag or told[tag] then
    return
  end
  told[tag] = true
  redis_pcall('PUBLISH', match(tag, '^(.-):{') .. ':given-back', tag)
end

-- What limit `l` at key `k` holds at `now`, as an allowed verdict of a
-- request of nothing whose fourth integer is the units an operator
-- granted that are in force (a fixed window's, which alone has a grant;
-- State::granted): 1, remaining, next_ms, granted.
local function held(l, k, now)
  local _, remaining, reset, _, _, _, read = l[1](k, l[3], l[4], now, 0, l[5])
  local granted = 0
  if l[8] then
    granted = type(read) == 'table' and read[1] or read
  end
  return 1, max(remaining, 0), reset, granted
end

-- Settles one request's reservation against `limits`, whose keys start at
-- KEYS[key], and writes what each limit holds afterwards into `reply` from
-- reply[out] as an allowed verdict (held): the units remaining once
-- settled.
-- Settling below the reservation gives units back: see given_back. A
-- limit counting requests is left as decided, unless `refused`: then the
-- request was refused after all, and it gets back the one it took.
local function settle_one(KEYS, key, limits, now, at, reserved, used, refused, reply, out)
  local told = nil
  for i = 1, #limits do
    local l, o, k = limits[i], out + (i - 1) * 4, KEYS[key + i - 1]
    local took = reserved
    if l[7] then
      took = refused and 1 or nil
    end
    if took then
      l[6](k, l[3], l[4], now, l[5], at, took, used)
      if used < took then
        told = told or {}
        given_back(k, told)
      end
    end
    reply[o], reply[o + 1], reply[o + 2], reply[o + 3] = held(l, k, now)
  end
end

-- An operator's grant of `units` to one request's `limits` (a credit on
-- the admin listener): a fixed window admits that many more in its
-- current window; the others get back what a reservation of `units` taken
-- now and settled to nothing would (see each algorithm's grant or
-- settle). Written into `reply` as settle_one writes; tells the instances.
local function grant_one(KEYS, key, limits, now, units, reply, out)
  local told = {}
  for i = 1, #limits do
    local l, o, k = limits[i], out + (i - 1) * 4, KEYS[key + i - 1]
    if l[8] then
      l[8](k, l[3], l[4], now, l[5], units)
    else
      l[6](k, l[3], l[4], now, l[5], now, units, 0)
    end
    given_back(k, told)
    reply[o], reply[o + 1], reply[o + 2], reply[o + 3] = held(l, k, now)
  end
end

-- struct.pack's format for `n` integers, made once per length.
local formats = {}
local function packing(n)
  local format = formats[n]
  if not format then
    format = '<' .. string.rep('i8', n)
    formats[n] = format
  end
  return format
end

-- The integers of `reply` packed into one string, at most PACKED at a
-- time: unpack() puts every value on Lua's C stack, which holds a few
-- thousand, and a call may carry many limits.
local PACKED = 256
local function packed(reply)
  local n = #reply
  if n <= PACKED then
    return pack(packing(n), unpack(reply))
  end
  local parts = {}
  for i = 1, n, PACKED do
    local j = min(i + PACKED - 1, n)
    parts[#parts + 1] = pack(packing(j - i + 1), unpack(reply, i, j))
  end
  return concat(parts)
end

local bound = false

local function decide(KEYS, ARGV)
  if not bound then
    bind()
    bound = true
  end
  -- Every request's limits first, so that a malformed call decides
  -- nothing at all.
  -- settles: the settlements among the requests, by position; made only
  -- for a call that carries one.
  local requests, settles, keys = {}, nil, 0
  for at = 1, #ARGV, 3 do
    local limits, unknown = limits_of(ARGV[at + 2])
    if not limits then
      return redis.error_reply('floodgate: unknown algorithm ' .. tostring(unknown))
    end
    requests[#requests + 1] = limits
    keys = keys + #limits
    if not tonumber(ARGV[at + 1]) then
      local used, reserved_at, reserved = match(ARGV[at + 1], '^(%d+) (%d+) (%d+)$')
      local granted = match(ARGV[at + 1], '^g (%d+)$')
      local refused_at, refused = match(ARGV[at + 1], '^r (%d+) (%d+)$')
      if granted then
        settles = settles or {}
        settles[#requests] = {nil, nil, tonumber(granted)}
      elseif refused_at then
        settles = settles or {}
        settles[#requests] = {0, tonumber(refused_at), tonumber(refused), true}
      elseif not used then
        return redis.error_reply('floodgate: bad cost ' .. tostring(ARGV[at + 1]))
      else
        settles = settles or {}
        settles[#requests] = {tonumber(used), tonumber(reserved_at), tonumber(reserved)}
      end
    end
  end
  if keys ~= #KEYS then
    return redis.error_reply('floodgate: ' .. #KEYS .. ' keys for ' .. keys .. ' limits')
  end

  local reply = {}
  -- A key several requests use is read once and written back once, after
  -- the last request (prelude.lua: begin, load, save, write_back).
  begin(KEYS)
  -- Redis TIME, asked at most once per call: the requests of one call are
  -- decided at one moment.
  local time = nil
  local key, out = 1, 1
  for i = 1, #requests do
    local at = i * 3 - 2
    local now = tonumber(ARGV[at])
    if not now then
      if not time then
        local t = redis_call('TIME')
        time = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
      end
      now = time
    end
    local limits = requests[i]
    local settle = settles and settles[i]
    if settle and not settle[1] then
      grant_one(KEYS, key, limits, now, settle[3], reply, out)
    elseif settle then
      settle_one(KEYS, key, limits, now, settle[2], settle[3], settle[1], settle[4], reply, out)
    else
      decide_one(KEYS, key, limits, now, tonumber(ARGV[at + 1]), reply, out)
    end
    key = key + #limits
    out = out + #limits * 4
    reply[out] = now
    out = out + 1
  end
  write_back()
  return packed(reply)
end
