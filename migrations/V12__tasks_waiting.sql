-- How many tasks each user has waiting (submitted or queued), kept by the tasks projection in
-- the transaction that writes the tasks' rows: the per-user queue limit reads one row here
-- instead of listing the user's waiting tasks (which grew with the queue a user may fill).
CREATE TABLE tasks_waiting (
    user_id uuid    PRIMARY KEY,
    waiting integer NOT NULL
);
INSERT INTO tasks_waiting (user_id, waiting)
SELECT user_id, count(*) FROM tasks WHERE status IN ('submitted', 'queued') GROUP BY user_id;
