-- floodgate: generic cell rate algorithm.
-- One unit per emission interval `window / limit`, with bursts of up to
-- `burst` units. The theoretical arrival time (TAT) is kept as whole
-- milliseconds plus a fraction in 1/`limit` ms, so the interval is exact
-- even when `limit` does not divide `window` (no float drift, no epoch
-- rebasing: only TAT − now is ever scaled, and it stays small).
-- Key: "<TAT whole ms> <TAT fraction>"; it expires at the TAT, after which a
-- missing key means the same as the old one: no backlog.
-- With a `delay` (ms), a request past the burst whose TAT would be at most
-- the delay beyond the tolerance is admitted held: check answers 2 and the
-- wait until it fits (what a denial without a delay would tell), and
-- commit takes its units now, so every later request is decided behind
-- it; a refusal is told when it would be admitted, held the whole delay.
local function gcra()
  local function check(key, limit, window, now, cost, burst, delay)
    local tolerance = window * burst
    -- How far the TAT is ahead of now, in 1/limit ms.
    local before = 0
    local tat_ms, tat_frac = load(key)
    if tat_ms and tat_ms >= now then
      before = (tat_ms - now) * limit + tat_frac
    end
    local after = before + window * cost
    -- Until one more emission interval fits under the tolerance, with
    -- `ahead` outstanding; 0 when nothing is (the bucket is full).
    local function next_unit(ahead)
      if ahead <= 0 then
        return 0
      end
      local units = floor_div(max(tolerance - ahead, 0), window)
      return ceil_div(ahead - tolerance + (units + 1) * window, limit)
    end
    if after <= tolerance then
      return 1, floor_div(tolerance - after, window), next_unit(after), 0, after
    end
    local wait = ceil_div(after - tolerance, limit)
    if delay and wait <= delay then
      return 2, 0, next_unit(after), wait, after
    end
    -- A clock that stepped back leaves the TAT further ahead than the
    -- tolerance: nothing remains.
    -- Refused: told when it would be admitted, held the whole delay.
    return 0, floor_div(max(tolerance - before, 0), window), next_unit(before), wait - (delay or 0), after
  end

  local function commit(key, limit, window, now, cost, burst, after)
    local whole = floor_div(after, limit)
    save(key, ceil_div(after, limit), now + whole, after - whole * limit)
  end

  -- Settles a reservation of `reserved` units taken at `at` to `used`
  -- (algorithms/gcra.rs, settle): more units push the TAT on, past the
  -- tolerance if need be; unused ones pull it back, at most by what has
  -- not refilled since `at`.
  local function settle(key, limit, window, now, burst, at, reserved, used)
    if used == reserved then
      return
    end
    local ahead = 0
    local tat_ms, tat_frac = load(key)
    if tat_ms and tat_ms >= now then
      ahead = (tat_ms - now) * limit + tat_frac
    end
    if used > reserved then
      ahead = ahead + window * (used - reserved)
    else
      local give = min((reserved - used) * window, reserved * window - max(now - at, 0) * limit)
      if give <= 0 or ahead == 0 then
        return
      end
      ahead = ahead - min(give, ahead)
    end
    commit(key, limit, window, now, 0, burst, ahead)
  end

  return check, commit, settle
end
