-- floodgate: sliding window counter.
-- The current aligned window's count plus the previous window's count
-- weighted by how much of it the trailing window still covers:
--   previous × (window − elapsed) / window + current + cost ≤ limit,
-- compared in whole unit-milliseconds so no rounding can admit extra units.
-- Key: "<current window start> <its count> <previous window's count>"; it
-- expires when the current window stops mattering (two windows after the
-- start). A `now` before the key's window (the clock stepped back) is read
-- as that window's start.
local function sliding_window()
  -- The wait from `now` until `cost` more units fit beside `cur` in the
  -- window that starts at `start` and `prev` in the one before; called only
  -- when they do not fit now.
  local function wait(limit, window, now, start, cur, prev, cost)
    if cost > limit then
      -- Never fits: told the wait until the limit is whole again.
      if cur > 0 then
        return start + 2 * window - now
      elseif prev > 0 then
        return start + window - now
      end
      return window
    end
    if cur + cost <= limit then
      -- Later in this window, once enough of the previous one has slid out.
      return start + window - floor_div((limit - cost - cur) * window, prev) - now
    end
    -- Not before the next window, where this one's count is the previous.
    return (start + window - now) + (window - floor_div((limit - cost) * window, cur))
  end

  -- The wait from `now` until the weighted count of `cur` in the window
  -- that starts at `start` (`elapsed` into it) and `prev` in the one before
  -- falls by a unit; 0 when nothing is counted.
  local function next_unit(window, now, start, elapsed, cur, prev)
    local weighted = prev * (window - elapsed)
    if weighted > 0 then
      local counted = ceil_div(weighted, window)
      return start + window - floor_div((counted - 1) * window, prev) - now
    end
    if cur > 0 then
      return (start + window - now) + (window - floor_div((cur - 1) * window, cur))
    end
    return 0
  end

  local function check(key, limit, window, now, cost)
    local s, c, p = load(key)
    -- The counts are read at `t`, never before the key's window; waits are
    -- told from `now`.
    local t = now
    if s and s > now then
      t = s
    end
    local start = t - (t % window)
    local cur, prev = 0, 0
    if s == start then
      cur, prev = c, p or 0
    elseif s == start - window then
      prev = c
    end

    local elapsed = t - start
    local weighted = prev * (window - elapsed)
    local allowed = weighted + (cur + cost) * window <= limit * window
    local used = ceil_div(weighted, window) + cur
    if allowed then
      used = used + cost
    end
    local remaining = max(limit - used, 0)
    if allowed then
      local more = next_unit(window, now, start, elapsed, cur + cost, prev)
      return 1, remaining, more, 0, cur, prev, start
    end
    local more = next_unit(window, now, start, elapsed, cur, prev)
    local retry = wait(limit, window, now, start, cur, prev, cost)
    return 0, remaining, more, retry, cur, prev, start
  end

  local function commit(key, limit, window, now, cost, burst, cur, prev, start)
    save(key, start + 2 * window - now, start, cur + cost, prev)
  end

  -- Settles a reservation of `reserved` units taken at `at` to `used`
  -- (algorithms/sliding_window.rs, settle): more is counted in the current window;
  -- less is given back to the window it went into, while that is the
  -- current or the previous one. It reads the key as check does; check
  -- keeps its reading inline, as every decision runs it and a Lua call
  -- costs Redis CPU.
  local function settle(key, limit, window, now, burst, at, reserved, used)
    local s, c, p = load(key)
    local t = now
    if s and s > now then
      t = s
    end
    local start = t - (t % window)
    local cur, prev = 0, 0
    if s == start then
      cur, prev = c, p or 0
    elseif s == start - window then
      prev = c
    end
    if used > reserved then
      cur = cur + used - reserved
    elseif used < reserved then
      local back, from = reserved - used, at - (at % window)
      if from == start then
        cur = cur - min(back, cur)
      elseif from == start - window then
        prev = prev - min(back, prev)
      else
        return
      end
    else
      return
    end
    save(key, start + 2 * window - now, start, cur, prev)
  end

  return check, commit, settle
end
