mod compressed;
mod mariadb;
mod seat;
