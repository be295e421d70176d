-- floodgate: fixed window.
-- At most `limit` units in each window aligned to multiples of `window`,
-- or, by the calendar, between the boundaries `window` lists (span()).
-- Key: "<window start> <units counted in it>", and " <units granted>"
-- when an operator granted units in that window beyond the limit (grant);
-- it expires when its window ends. A key left from an earlier window reads as empty; a `now` before
-- the key's window (the clock stepped back) is read as that window's start,
-- so the window that was counted is never counted afresh.
local function fixed_window()
  -- Stores the key for the window at `start` (length `len`). A window by
  -- the calendar is kept past its end, until the end of the window after
  -- it, with its end as a fourth number ("start count granted end"), so
  -- that its total can be exported once it has closed; when a write moves
  -- a client past such a window that counted anything, the window's total
  -- moves to "<key>:closed:<its start>" ("end count", kept as long), in
  -- the same slot (export.rs reads both).
  local function write(key, window, now, start, len, count, extra, s, c, e)
    if type(window) ~= 'table' then
      if extra == 0 then
        extra = nil
      end
      return save(key, start + len - now, start, count, extra)
    end
    local ends = start + len
    local next_start, next_len = span(ends, window)
    local kept = next_start + next_len - now
    if s and s ~= start and c > 0 then
      local closed = e
      if not closed then
        local cs, cl = span(s, window)
        closed = cs + cl
      end
      local _, closed_len = span(closed, window)
      redis_call('SET', key .. ':closed:' .. int(s), int(closed) .. ' ' .. int(c), 'PX',
        int(max(closed + closed_len - now, 1) + EXPIRY_SLACK_MS))
    end
    save(key, kept, start, count, extra, ends)
  end

  -- Reads the key as of the window `now` falls in (the window is chosen at
  -- `t`, never before the key's; waits are told from `now`): its start,
  -- length, count and the units granted in it, and the key's own numbers.
  local function read(key, window, now)
    local s, c, e, ends = load(key)
    local t = now
    if s and s > now then
      t = s
    end
    local start, len = span(t, window)
    if s == start then
      return start, len, c, e or 0, s, c, ends
    end
    return start, len, 0, 0, s, c, ends
  end

  -- Reads the key as read() does, inline: every decision runs it, and a
  -- Lua call (or a second GET in commit) costs Redis CPU. What it read
  -- goes to commit: the count, the window's start, and the units granted,
  -- or for a window by the calendar {granted, the key's start, count and
  -- end}.
  local function check(key, limit, window, now, cost)
    local s, c, e, ends = load(key)
    local t = now
    if s and s > now then
      t = s
    end
    local start, len = span(t, window)
    local count, extra = 0, 0
    if s == start then
      count, extra = c, e or 0
    end
    local reset = start + len - now
    local read = extra
    if type(window) == 'table' then
      read = {extra, s, c, ends}
    end
    if count + cost <= limit + extra then
      -- More units come only with the next window: `t` is its start;
      -- none are to come back while the window has counted nothing.
      local more = reset
      if count + cost == 0 then
        more = 0
      end
      return 1, limit + extra - count - cost, more, 0, count, start, read
    end
    local more = reset
    if count == 0 then
      more = 0
    end
    return 0, limit + extra - count, more, reset, count, start, read
  end

  local function commit(key, limit, window, now, cost, burst, count, start, read)
    local _, len = span(start, window)
    if type(read) ~= 'table' then
      return write(key, window, now, start, len, count + cost, read)
    end
    write(key, window, now, start, len, count + cost, read[1], read[2], read[3], read[4])
  end

  -- Settles a reservation of `reserved` units taken at `at` to `used`
  -- (algorithms/fixed_window.rs, settle): more is counted in the current window;
  -- less is given back only while the reservation's window is current.
  local function settle(key, limit, window, now, burst, at, reserved, used)
    local start, len, count, extra, s, c, ends = read(key, window, now)
    if used > reserved then
      count = count + used - reserved
    elseif used < reserved and start == span(at, window) then
      count = count - min(reserved - used, count)
    else
      return
    end
    write(key, window, now, start, len, count, extra, s, c, ends)
  end

  -- An operator's grant of `units` (State::grant): that many more are
  -- admitted in the current window, past the limit, until it ends.
  local function grant(key, limit, window, now, burst, units)
    local start, len, count, extra, s, c, ends = read(key, window, now)
    write(key, window, now, start, len, count, extra + units, s, c, ends)
  end

  return check, commit, settle, grant
end
