-- The admin's servers page counts, per server, the tasks running there and the tasks sent there
-- that wait to run next. Only tasks in flight are in this index, so it stays as small as the pool's
-- work at any moment.
CREATE INDEX tasks_in_flight_by_backend ON tasks (backend, status)
    WHERE status IN ('dispatched', 'running');
